"""Chat-template rendering.

* The model's own templates render exactly as transformers renders them (``compile_chat_template``: the
  same sandboxed jinja environment, filters and globals), compiled once into a bounded LRU cache.
* Templates a *request* supplies (``chat_template_kwargs.chat_template``, only accepted with
  ``--trust-request-chat-template``) are hostile input. ``RequestTemplateRenderer`` renders them in a
  separate worker process (jinja only, no model) that the server can kill: a wall-clock limit (an alarm
  inside the worker, then SIGKILL), an address-space limit (``RLIMIT_AS``), a source-size limit, an
  output-size limit (``Template.generate()`` counting UTF-8 bytes), caps on what one operation may build
  (``*``, ``**``, ``%``, ``+``, ``~``, ``range``, padding and replacing filters and methods) and an LRU cache
  of compiled templates. A worker that overran a limit is replaced, so its memory goes back to the system.
* ``check_chat_template_kwargs`` is the server's policy for ``chat_template_kwargs``: names the server
  sets itself (``messages``, ``tools``, ``bos_token``, ...) are refused, values must be small JSON.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import json
import logging
import math
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, ClassVar

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.compiler import CodeGenerator, Frame, optimizeconst
from jinja2.sandbox import ImmutableSandboxedEnvironment

from g4serve.processing.gemma4_template import TEMPLATE_GLOBALS, linear_lookback, linear_template

log = logging.getLogger("g4serve.chat_template")


class ChatTemplateError(ValueError):
    """The chat template rejected the conversation (its ``raise_exception``) or cannot render it."""


class ChatTemplateLimitError(ChatTemplateError):
    """A request-supplied chat template ran past one of its limits (time, memory, output or value size)."""


# ---- the environment transformers uses (transformers.utils.chat_template_utils) ----


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (assistant-mask markers) renders its body unchanged."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Callable[[], str]) -> str:
        return caller()


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja's namespace(), refusing underscore attributes like transformers does (sandbox hardening)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # jinja's own signature trick: `self` may be a key
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} may not start with '_'")


class _TemplateDict:
    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # Unlike jinja's own filter this does not HTML-escape, exactly as transformers.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _setup(env: jinja2.Environment) -> jinja2.Environment:
    env.filters["tojson"] = _tojson
    env.globals.update(
        raise_exception=_raise_exception,
        dict=_TemplateDict(),
        namespace=_TemplateNamespace,
        strftime_now=lambda fmt: datetime.now().strftime(fmt),
    )
    return env


_ENV_OPTIONS: Mapping[str, Any] = {
    "trim_blocks": True,
    "lstrip_blocks": True,
    "extensions": [_GenerationTag, jinja2.ext.loopcontrols],
}


def compile_chat_template(template: str) -> jinja2.Template:
    """Compile a chat template in the jinja environment transformers uses (Gemma 4's made linear in the
    size of the conversation, rendering the same text: ``gemma4_template.linear_template``)."""
    env = _setup(ImmutableSandboxedEnvironment(**_ENV_OPTIONS))
    env.globals.update(TEMPLATE_GLOBALS)
    try:
        return env.from_string(linear_template(template))
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"chat template: syntax error at line {exc.lineno}: {exc.message}") from None


# transformers caches compiled templates the same way (an lru_cache on _compile_jinja_template).
cached_chat_template = functools.lru_cache(maxsize=32)(compile_chat_template)


# ---- limits for request-supplied templates ----


@dataclasses.dataclass(frozen=True)
class ChatTemplateLimits:
    """Hard limits on rendering one request-supplied chat template."""

    timeout_s: float = 2.0  # wall clock for compiling + rendering; the worker is killed 1 s later
    max_source_bytes: int = 64 << 10  # template text (UTF-8)
    max_output_bytes: int = 4 << 20  # rendered prompt (UTF-8)
    max_value_len: int = 4 << 20  # chars / items of any string, list or dict one operation builds
    max_range: int = 100_000  # items of one range()
    max_width: int = 100_000  # padding/width/count arguments (center, indent, wordwrap, batch, %10d, ...)
    max_int_bits: int = 4096  # size of an integer `*` or `**` may produce
    memory_bytes: int = 1 << 30  # address space of the worker process (RLIMIT_AS)
    cache_size: int = 32  # compiled templates kept by a worker (LRU)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if not getattr(self, f.name) > 0:
                raise ValueError(f"ChatTemplateLimits.{f.name}: must be positive")


_BRACE_SPEC = re.compile(r"\{[^{}:]*:((?:[^{}]|\{[^{}]*\})*)\}")  # the spec of each {field:spec}
_FORMAT_WIDTH = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")


def _sized(value: Any) -> int:
    return len(value) if isinstance(value, (str, list, tuple, dict, set, frozenset, bytes)) else 0


class _LimitedCodeGenerator(CodeGenerator):
    """jinja's code generator, but ``a ~ b`` goes through ``environment.g4_concat`` (size-checked)."""

    @optimizeconst
    def visit_Concat(self, node: jinja2.nodes.Concat, frame: Frame) -> None:
        self.write("environment.g4_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class LimitedSandboxEnvironment(ImmutableSandboxedEnvironment):
    """transformers' template environment with caps on what one operation may build, for templates that
    come with a request. (Time and memory are bounded by the worker process that renders them.)"""

    code_generator_class = _LimitedCodeGenerator
    intercepted_binops = frozenset({"*", "**", "%", "+"})

    def __init__(self, limits: ChatTemplateLimits) -> None:
        super().__init__(**_ENV_OPTIONS)
        self.limits = limits
        _setup(self)
        self.globals["range"] = self._range
        self.globals["strftime_now"] = self._strftime_now
        self.filters = {name: self._limited_filter(name, f) for name, f in self.filters.items()}

    # -- checks --
    def _fail(self, message: str) -> ChatTemplateLimitError:
        return ChatTemplateLimitError(f"chat template: {message}")

    def _check_value(self, value: Any) -> Any:
        if _sized(value) > self.limits.max_value_len:
            limit = self.limits.max_value_len
            raise self._fail(f"a value of {_sized(value)} characters/items exceeds the limit of {limit}")
        return value

    def _check_width(self, width: Any, what: str) -> None:
        if isinstance(width, int) and abs(width) > self.limits.max_width:
            raise self._fail(f"{what} {width} exceeds the limit of {self.limits.max_width}")

    def _check_length(self, length: int, what: str) -> None:
        if length > self.limits.max_value_len:
            raise self._fail(
                f"{what} would build {length} characters/items (limit {self.limits.max_value_len})"
            )

    def _check_format(self, fmt: Any, args: Any) -> None:
        if not isinstance(fmt, str):
            return
        for match in _FORMAT_WIDTH.finditer(fmt):
            for part in match.groups():
                if part and part.isdigit():
                    self._check_width(int(part), "format width")
        for arg in args if isinstance(args, tuple) else (args,):
            if "*" in fmt:
                self._check_width(arg, "format width")

    def _check_brace_format(self, fmt: str, args: tuple) -> None:
        """Widths and precisions in ``str.format`` fields (``{:>99999999}``, ``{:{w}}``)."""
        for spec in _BRACE_SPEC.findall(fmt):
            for digits in re.findall(r"\d+", spec):
                self._check_width(int(digits), "format width")
            if "{" in spec:
                for arg in args:
                    self._check_width(arg, "format width")

    # -- operators --
    def call_binop(  # noqa: C901 - one branch per operator
        self, context: jinja2.runtime.Context, operator: str, left: Any, right: Any
    ) -> Any:
        if operator == "*":
            for seq, count in ((left, right), (right, left)):
                if _sized(seq) and isinstance(count, int):
                    self._check_length(_sized(seq) * max(count, 0), "'*'")
            if isinstance(left, int) and isinstance(right, int):
                if left.bit_length() + right.bit_length() > self.limits.max_int_bits:
                    raise self._fail(f"'*' would build an integer over {self.limits.max_int_bits} bits")
        elif operator == "**":
            if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0:
                if left.bit_length() * right > self.limits.max_int_bits:
                    raise self._fail(f"'**' would build an integer over {self.limits.max_int_bits} bits")
        elif operator == "%":
            self._check_format(left, right)
        elif operator == "+" and _sized(left) and _sized(right):
            self._check_length(_sized(left) + _sized(right), "'+'")
        return self._check_value(super().call_binop(context, operator, left, right))

    def g4_concat(self, parts: tuple) -> str:
        strings = [p if isinstance(p, str) else str(p) for p in parts]
        self._check_length(sum(len(s) for s in strings), "'~'")
        return "".join(strings)

    # -- calls, filters, globals --
    def call(__self, __context: jinja2.runtime.Context, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        target = getattr(__obj, "__wrapped__", __obj)  # the sandbox wraps str.format / format_map
        owner = getattr(target, "__self__", None)
        name = getattr(target, "__name__", "")
        if isinstance(owner, str):
            if name in ("center", "ljust", "rjust", "zfill") and args:
                __self._check_width(args[0], f"{name}() width")
            elif name == "expandtabs":
                __self._check_length(
                    len(owner) * max(args[0] if args and isinstance(args[0], int) else 8, 1), name
                )
            elif (
                name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str)
            ):
                count = owner.count(args[0]) if args[0] else len(owner) + 1
                __self._check_length(len(owner) + count * max(len(args[1]) - len(args[0]), 0), "replace()")
            elif name == "join" and len(args) == 1:
                items = args[0] if isinstance(args[0], (list, tuple)) else list(args[0])
                __self._check_length(sum(_sized(x) for x in items) + len(owner) * len(items), "join()")
                args = (items,)
            elif name in ("format", "format_map"):
                __self._check_brace_format(owner, (*args, *kwargs.values()))
        return __self._check_value(super().call(__context, __obj, *args, **kwargs))

    def _range(self, *args: int) -> range:
        rng = range(*args)
        if len(rng) > self.limits.max_range:
            raise self._fail(f"range() of {len(rng)} items exceeds the limit of {self.limits.max_range}")
        return rng

    def _strftime_now(self, fmt: str) -> str:
        if _sized(fmt) > 256:
            raise self._fail("strftime_now() format longer than 256 characters")
        return datetime.now().strftime(fmt)

    def _filter_precheck(self, name: str, a: dict[str, Any]) -> None:  # noqa: C901 - one branch per filter
        """What a filter would build, checked before it builds it (``a``: its bound arguments)."""
        if name in ("center", "batch", "slice"):
            for arg in ("width", "linecount", "slices"):
                self._check_width(a.get(arg), f"{name}() {arg}")
        elif name == "indent":
            s, width = a.get("s"), a.get("width")
            self._check_width(width, "indent() width")
            pad = width if isinstance(width, int) else _sized(width)
            if isinstance(s, str):
                self._check_length(len(s) + (s.count("\n") + 1) * max(pad, 0), "indent()")
        elif name == "wordwrap":
            s, width, wrap = a.get("s"), a.get("width"), a.get("wrapstring")
            self._check_width(width, "wordwrap() width")
            if isinstance(s, str) and isinstance(width, int):
                lines = len(s) // max(width, 1) + s.count(" ") + s.count("\n") + 1
                self._check_length(len(s) + lines * max(_sized(wrap), 1), "wordwrap()")
        elif name == "tojson":
            indent = a.get("indent")
            if isinstance(indent, int) and indent > 64 or isinstance(indent, str) and len(indent) > 64:
                raise self._fail("tojson() indent larger than 64")
        elif name == "replace":
            s, old, new = a.get("s"), a.get("old"), a.get("new")
            if isinstance(s, str):
                old, new = str(old), str(new)
                count = s.count(old) if old else len(s) + 1
                self._check_length(len(s) + count * max(len(new) - len(old), 0), "replace()")
        elif name == "format":
            self._check_format(
                a.get("value"), tuple(a.get("args", ())) or tuple(a.get("kwargs", {}).values())
            )
        elif name == "join":
            items, sep = a.get("value"), a.get("d")
            if isinstance(items, (list, tuple)):
                size = sum(_sized(x) or 20 for x in items) + _sized(sep) * len(items)
                self._check_length(size, "join()")
        elif name == "sum":
            start = a.get("start")
            if _sized(start) or isinstance(start, (list, tuple)):
                items = a.get("iterable")
                if isinstance(items, (list, tuple)):
                    self._check_length(_sized(start) + sum(_sized(x) for x in items), "sum()")

    def _limited_filter(self, name: str, func: Callable) -> Callable:
        env = self
        try:
            signature = inspect.signature(func)
        except (TypeError, ValueError):
            signature = None

        @functools.wraps(func)  # keeps jinja_pass_arg (pass_context/pass_environment)
        def limited(*args: Any, **kwargs: Any) -> Any:
            if signature is not None:
                if name in ("join", "sum") and len(args) >= 2 and not isinstance(args[1], (list, tuple)):
                    args = (args[0], list(args[1]), *args[2:])  # a generator: count what it yields
                try:
                    bound = signature.bind(*args, **kwargs)
                except TypeError:
                    bound = None
                if bound is not None:
                    bound.apply_defaults()
                    env._filter_precheck(name, bound.arguments)
            return env._check_value(func(*args, **kwargs))

        return limited


def compile_request_template(source: str, limits: ChatTemplateLimits) -> jinja2.Template:
    """Compile a request-supplied template in ``LimitedSandboxEnvironment`` (no time limit of its own)."""
    size = len(source.encode("utf-8", "surrogatepass"))
    if size > limits.max_source_bytes:
        raise ChatTemplateLimitError(
            f"chat template: {size} bytes exceed the limit of {limits.max_source_bytes} bytes"
        )
    env = LimitedSandboxEnvironment(limits)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"chat template: syntax error at line {exc.lineno}: {exc.message}") from None


def render_bounded(
    template: jinja2.Template, variables: Mapping[str, Any], limits: ChatTemplateLimits
) -> str:
    """Render through ``Template.generate()``, stopping once the output passes ``max_output_bytes``."""
    pieces, size = [], 0
    for piece in template.generate(**variables):
        size += len(piece.encode("utf-8", "surrogatepass"))
        if size > limits.max_output_bytes:
            raise ChatTemplateLimitError(
                f"chat template: the rendered prompt exceeds the limit of {limits.max_output_bytes} bytes"
            )
        pieces.append(piece)
    return "".join(pieces)


# ---- the worker process ----


class _Deadline(BaseException):  # noqa: N818 - BaseException so no `except Exception` in jinja swallows it
    pass


def _on_alarm(_signum: int, _frame: Any) -> None:
    raise _Deadline


def template_cache(limits: ChatTemplateLimits) -> Callable[[str], jinja2.Template]:
    """``compile_request_template`` behind an LRU cache of ``limits.cache_size`` templates."""
    compile_one = functools.partial(compile_request_template, limits=limits)
    return functools.lru_cache(maxsize=limits.cache_size)(compile_one)


def _render_request(
    source: str,
    variables: Mapping[str, Any],
    limits: ChatTemplateLimits,
    compiled: Callable[[str], jinja2.Template],
) -> tuple[str, str]:
    """``("ok", prompt)``, ``("error", message)`` or ``("limit", message)``: one render in the worker."""
    try:
        signal.setitimer(signal.ITIMER_REAL, limits.timeout_s)
        try:
            return "ok", render_bounded(compiled(source), variables, limits)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except _Deadline:
        return "limit", f"chat template: rendering took longer than the limit of {limits.timeout_s:g} s"
    except MemoryError:
        return "limit", f"chat template: rendering exceeded the memory limit of {limits.memory_bytes} bytes"
    except RecursionError:
        return "limit", "chat template: recursion too deep"
    except ChatTemplateLimitError as exc:
        return "limit", str(exc)
    except ChatTemplateError as exc:  # raise_exception's message is the template's to choose, but bounded
        return "error", _short(str(exc))
    except jinja2.TemplateError as exc:
        return "error", f"chat template: {_short(str(exc))}"
    except Exception as exc:  # noqa: BLE001 - anything the template did wrong is the caller's problem
        return "error", f"chat template: {type(exc).__name__}: {_short(str(exc))}"


def _short(text: str, limit: int = 1000) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def _worker_main(fd: int, limits_json: str) -> None:
    """Entry point of the worker process (``python -c``): answer renders on ``fd`` until it closes."""
    import resource

    limits = ChatTemplateLimits(**json.loads(limits_json))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server's Ctrl-C is the server's to handle
    signal.signal(signal.SIGALRM, _on_alarm)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes))
    conn = Connection(fd)
    compiled = template_cache(limits)
    conn.send(("ready", os.getpid()))
    while True:
        try:
            source, variables = conn.recv()
        except (EOFError, OSError):
            return
        except MemoryError:
            conn.send(("limit", "chat template: the request exceeded the renderer's memory limit"))
            return
        reply = _render_request(source, variables, limits, compiled)
        del variables
        try:
            conn.send(reply)
        except MemoryError:
            return
        if reply[0] == "limit":
            return  # let the server start a fresh worker: whatever this one grew goes back to the system


_KILL_GRACE_S = 1.0  # after timeout_s the worker's own alarm should have answered; then it is killed
_START_TIMEOUT_S = 60.0


class RequestTemplateRenderer:
    """Renders request-supplied chat templates in a worker process, one at a time.

    ``render`` blocks (call it from a thread: ``executor`` is this renderer's own single thread, so queued
    renders wait without holding anyone else's threads). A render that overruns a limit raises
    ``ChatTemplateLimitError`` and the worker is replaced; the worker is started on first use.
    """

    def __init__(self, limits: ChatTemplateLimits | None = None) -> None:
        self.limits = limits or ChatTemplateLimits()
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="g4serve-request-template")
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._conn: Connection | None = None

    @property
    def worker_pid(self) -> int | None:
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    def render(self, source: str, variables: Mapping[str, Any]) -> str:
        size = len(source.encode("utf-8", "surrogatepass"))
        if size > self.limits.max_source_bytes:
            raise ChatTemplateLimitError(
                f"chat template: {size} bytes exceed the limit of {self.limits.max_source_bytes} bytes"
            )
        with self._lock:
            conn = self._send(source, dict(variables))
            try:
                ready = conn.poll(self.limits.timeout_s + _KILL_GRACE_S)
                status, payload = conn.recv() if ready else (None, None)
            except (EOFError, OSError):
                status = payload = None
            if status is None:
                alive = self._proc is not None and self._proc.poll() is None
                self._stop()
                if alive:
                    raise ChatTemplateLimitError(
                        f"chat template: rendering took longer than the limit of {self.limits.timeout_s:g} s"
                    )
                raise ChatTemplateLimitError(
                    "chat template: the renderer stopped (memory limit of "
                    f"{self.limits.memory_bytes} bytes or a crash) while rendering it"
                )
            if status == "limit":
                self._stop()  # the worker exits after a limit; reap it
        if status == "ok":
            return payload
        if status == "limit":
            raise ChatTemplateLimitError(payload)
        raise ChatTemplateError(payload)

    def _send(self, source: str, variables: dict) -> Connection:
        for attempt in (1, 2):  # a worker that died since the last render is replaced once
            conn = self._start()
            try:
                conn.send((source, variables))
                return conn
            except (OSError, EOFError):
                self._stop()
                if attempt == 2:
                    raise ChatTemplateLimitError("chat template: the renderer could not be started") from None
        raise AssertionError("unreachable")

    def _start(self) -> Connection:
        if self._conn is not None and self._proc is not None and self._proc.poll() is None:
            return self._conn
        self._stop()
        parent, child = socket.socketpair()
        limits = json.dumps(dataclasses.asdict(self.limits))
        code = (
            "import sys; from g4serve.processing.chat_template import _worker_main; "
            f"_worker_main({child.fileno()}, sys.argv[1])"
        )
        package_root = str(Path(__file__).resolve().parents[2])  # where `import g4serve` finds this module
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])),
        }
        try:
            self._proc = subprocess.Popen(  # noqa: S603 - our own interpreter and module
                [sys.executable, "-c", code, limits],
                pass_fds=(child.fileno(),),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                env=env,
                cwd=package_root,  # `python -c` imports from its working directory first
            )
        finally:
            child.close()
        self._conn = Connection(parent.detach())
        began = time.monotonic()
        if not self._conn.poll(_START_TIMEOUT_S) or self._conn.recv()[0] != "ready":
            self._stop()
            raise ChatTemplateLimitError("chat template: the renderer did not start")
        log.debug("chat-template worker %d started in %.2f s", self._proc.pid, time.monotonic() - began)
        return self._conn

    def _stop(self) -> None:
        conn, proc, self._conn, self._proc = self._conn, self._proc, None, None
        if conn is not None:
            conn.close()
        if proc is not None:
            if proc.poll() is None:
                proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)

    def close(self) -> None:
        with self._lock:
            self._stop()
        self.executor.shutdown(wait=False, cancel_futures=True)


# ---- chat_template_kwargs policy ----

# What transformers' apply_chat_template / render_jinja_template set or consume themselves (its parameters,
# the variables it renders with, the tokenizer's special tokens), and the template's own functions.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "messages",
        "conversation",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "sanitize_control_tokens",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "bos_token",
        "eos_token",
        "unk_token",
        "sep_token",
        "pad_token",
        "cls_token",
        "mask_token",
        "additional_special_tokens",
        "image_token",
        "boi_token",
        "eoi_token",
        "audio_token",
        "boa_token",
        "eoa_token",
        "video_token",
        "raise_exception",
        "namespace",
        "dict",
        "range",
        "strftime_now",
        "lipsum",
        "cycler",
        "joiner",
        "self",
    }
)
MAX_KWARGS_DEPTH = 8  # nesting of lists/objects in one value
MAX_KWARGS_ITEMS = 1024  # scalars + containers across all values
MAX_KWARGS_STRING_BYTES = 64 << 10  # strings (keys included) across all values
_INT_BOUND = 1 << 63


def check_chat_template_kwargs(
    kwargs: Mapping[str, Any] | None, reserved: frozenset[str] | set[str] = frozenset()
) -> dict[str, Any]:
    """``chat_template_kwargs`` without ``chat_template`` (the caller decides about that one), checked:
    no names the server sets itself (``RESERVED_TEMPLATE_KWARGS``, ``reserved``, ``_private``), keys are
    identifiers, values are JSON of bounded size and depth. ``ValueError`` naming
    ``chat_template_kwargs.<key>`` otherwise."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, Mapping):
        raise ValueError("chat_template_kwargs: must be an object")
    budget = {"items": MAX_KWARGS_ITEMS, "bytes": MAX_KWARGS_STRING_BYTES}
    out: dict[str, Any] = {}
    for key, value in kwargs.items():
        if key == "chat_template":
            continue
        field = f"chat_template_kwargs.{key}"
        if not isinstance(key, str) or not key.isidentifier():
            raise ValueError(f"chat_template_kwargs: {str(key)[:64]!r} is not a valid template variable name")
        if key.startswith("_") or key in RESERVED_TEMPLATE_KWARGS or key in reserved:
            raise ValueError(f"{field}: set by the server, cannot be overridden")
        _check_json_value(value, field, 0, budget)
        out[key] = value
    return out


def _check_json_value(value: Any, field: str, depth: int, budget: dict[str, int]) -> None:  # noqa: C901
    budget["items"] -= 1
    if budget["items"] < 0:
        raise ValueError(f"{field}: chat_template_kwargs hold more than {MAX_KWARGS_ITEMS} values in all")
    if value is None or isinstance(value, bool):
        return
    if isinstance(value, int):
        if not -_INT_BOUND <= value < _INT_BOUND:
            raise ValueError(f"{field}: integers must fit in 64 bits")
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{field}: numbers must be finite")
        return
    if isinstance(value, str):
        budget["bytes"] -= len(value.encode("utf-8", "surrogatepass"))
        if budget["bytes"] < 0:
            raise ValueError(
                f"{field}: chat_template_kwargs hold more than {MAX_KWARGS_STRING_BYTES} bytes of text"
            )
        return
    if not isinstance(value, (list, dict)):
        raise ValueError(f"{field}: must be JSON (string, number, boolean, null, array or object)")
    if depth >= MAX_KWARGS_DEPTH:
        raise ValueError(f"{field}: nested deeper than {MAX_KWARGS_DEPTH} levels")
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise ValueError(f"{field}: object keys must be strings")
            _check_json_value(k, field, depth + 1, budget)
            _check_json_value(v, field, depth + 1, budget)
    else:
        for v in value:
            _check_json_value(v, field, depth + 1, budget)


__all__ = [
    "MAX_KWARGS_DEPTH",
    "MAX_KWARGS_ITEMS",
    "MAX_KWARGS_STRING_BYTES",
    "RESERVED_TEMPLATE_KWARGS",
    "ChatTemplateError",
    "ChatTemplateLimitError",
    "ChatTemplateLimits",
    "LimitedSandboxEnvironment",
    "RequestTemplateRenderer",
    "cached_chat_template",
    "check_chat_template_kwargs",
    "compile_chat_template",
    "compile_request_template",
    "linear_lookback",
    "render_bounded",
    "template_cache",
]
