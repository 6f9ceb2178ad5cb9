"""Gemma 4 tokenizer: loads a Hugging Face tokenizer directory and behaves exactly like transformers v5's
``AutoTokenizer`` (encode, decode, chat templates), plus an incremental detokenizer for streaming.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import jinja2
import numpy as np
import tokenizers
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers

from g4serve.processing.chat_template import (
    ChatTemplateError,
    RequestTemplateRenderer,
    cached_chat_template,
    compile_chat_template,
)

# Named special tokens transformers knows (PreTrainedTokenizerBase.SPECIAL_TOKENS_ATTRIBUTES), in its order.
_NAMED_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# GemmaTokenizer.__init__ defaults for tokens the config leaves out.
_GEMMA_NAMED_DEFAULTS = MappingProxyType(
    {
        "unk_token": "<unk>",
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "pad_token": "<pad>",
        "mask_token": "<mask>",
    }
)
# Gemma 4 multimodal tokens; used when tokenizer_config.json does not name them but the vocab has them.
GEMMA4_MULTIMODAL_TOKENS = MappingProxyType(
    {
        "image_token": "<|image|>",
        "boi_token": "<|image>",
        "eoi_token": "<image|>",
        "audio_token": "<|audio|>",
        "boa_token": "<|audio>",
        "eoa_token": "<audio|>",
        "video_token": "<|video|>",
    }
)
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: cannot read JSON ({exc})") from None


def _token_content(value: Any) -> str | None:
    """A token as tokenizer_config.json spells it: a string or a serialized AddedToken."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _load_chat_template(path: Path, config: Mapping[str, Any]) -> str | dict[str, str] | None:
    """transformers' priority: chat_template.jinja (+ additional_chat_templates/), then tokenizer_config.json;
    the processor's chat_template.json is a last resort."""
    templates: dict[str, str] = {}
    main = path / "chat_template.jinja"
    if main.is_file():
        templates["default"] = main.read_text(encoding="utf-8")
    extra_dir = path / "additional_chat_templates"
    if extra_dir.is_dir():
        for file in sorted(extra_dir.glob("*.jinja")):
            templates[file.name.removesuffix(".jinja")] = file.read_text(encoding="utf-8")
    if templates:
        return templates["default"] if list(templates) == ["default"] else templates
    template = config.get("chat_template")
    if template is None and (path / "chat_template.json").is_file():
        data = _read_json(path / "chat_template.json")
        template = data.get("chat_template") if isinstance(data, dict) else None
    if isinstance(template, list):  # saved as [{"name": ..., "template": ...}, ...]
        template = {t["name"]: t["template"] for t in template}
    return template


def set_gemma_pipeline(backend: tokenizers.Tokenizer) -> None:
    """Give ``backend`` the normalizer, pre-tokenizer and decoder of transformers' GemmaTokenizer."""
    backend.normalizer = normalizers.Replace(" ", "\u2581")
    backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    backend.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    )


def _apply_gemma_tokenizer_class(backend: tokenizers.Tokenizer, unk_token: str | None) -> None:
    """transformers' GemmaTokenizer rebuilds the backend from vocab/merges with its own BPE settings and
    pipeline, ignoring what tokenizer.json stores; do the same so both agree."""
    model = backend.model
    model.byte_fallback, model.fuse_unk, model.dropout, model.ignore_merges = True, True, None, False
    model.continuing_subword_prefix, model.end_of_word_suffix, model.unk_token = None, None, unk_token
    set_gemma_pipeline(backend)


# The chat template walks tools, tool calls' arguments and tool results value by value, each a few sandboxed
# steps (~8 us on the 2-core CPU) in a template thread that holds the interpreter lock: the body's own count
# (objects, arrays and strings) leaves numbers out, and 64 MiB of `1,` in an enum or an argument held a
# thread for minutes (1,000,000 of them: 8.4 s). A prompt holds fewer values than tokens (each renders as
# one at least, with its separator), so no conversation that fits a 256k context is refused by this bound.
MAX_TEMPLATE_VALUES = 1 << 18


def _plain(  # noqa: C901 - one flat isinstance dispatch
    value: Any, budget: list[int] | None = None, text: Callable[[str], str] | None = None
) -> Any:
    """Rebuild template inputs from plain JSON types; other objects (images, arrays) become "<TypeName>".
    ``budget``: ``[values left]``, spent by each value (keys too); a ``ValueError`` once spent. ``text``:
    applied to every string (``Tokenizer.as_text``: data that may not spell a control token)."""
    if budget is not None:
        budget[0] -= 1
        if budget[0] < 0:
            raise ValueError(
                f"messages: the conversation and its tools hold more than {MAX_TEMPLATE_VALUES} JSON values "
                "(strings, numbers, ... of messages, tool calls' arguments, tool results and tool schemas)"
            )
    if isinstance(value, str):
        plain = value if type(value) is str else str.__str__(value)
        return plain if text is None else text(plain)
    if value is None or type(value) in (int, float, bool):
        return value
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k, budget, text): _plain(v, budget, text) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v, budget, text) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v, budget, text) for v in value)
    if isinstance(value, np.generic):
        return _plain(value.item(), budget, text)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name), budget, text) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump(), budget, text)
    return f"<{type(value).__name__}>"


def _alias_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


class Tokenizer:
    """A Hugging Face tokenizer directory (tokenizer.json + tokenizer_config.json + chat template).

    Loading mirrors transformers v5: tokenizer_class "GemmaTokenizer" swaps in Gemma's normalizer/decoder,
    named and multimodal special tokens become special added tokens, and BOS comes from tokenizer.json's
    post-processor only.
    """

    # Gemma multimodal tokens (None when the vocabulary lacks them); set in __init__.
    image_token: str | None
    boi_token: str | None
    eoi_token: str | None
    audio_token: str | None
    boa_token: str | None
    eoa_token: str | None
    video_token: str | None
    image_token_id: int | None
    boi_token_id: int | None
    eoi_token_id: int | None
    audio_token_id: int | None
    boa_token_id: int | None
    eoa_token_id: int | None
    video_token_id: int | None

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        config: Mapping[str, Any] | None = None,
        chat_template: str | Mapping[str, str] | None = None,
        name_or_path: str = "",
    ) -> None:
        config = dict(config or {})
        self.name_or_path = name_or_path
        self._backend = backend
        self._token_texts: dict[int, str] = {}  # token_text's, at most one entry a vocabulary id
        # transformers ignores tokenizer.json's padding/truncation unless asked per call.
        backend.no_padding()
        backend.no_truncation()
        tokenizer_class = str(config.get("tokenizer_class") or "").removesuffix("Fast")
        self._is_bpe = isinstance(backend.model, models.BPE)

        named = {k: _token_content(config.get(k)) for k in _NAMED_TOKENS}
        if tokenizer_class == "GemmaTokenizer":
            named = {k: v if k in config else _GEMMA_NAMED_DEFAULTS.get(k) for k, v in named.items()}
            if self._is_bpe:
                _apply_gemma_tokenizer_class(backend, named["unk_token"])
        # Model-specific tokens: top-level "*_token" keys, then the extra_special_tokens dict (transformers).
        extra = config.get("extra_special_tokens") or config.get("additional_special_tokens")
        specific = {
            k: _token_content(v)
            for k, v in config.items()
            if k.endswith("_token") and k not in _NAMED_TOKENS and _token_content(v) is not None
        }
        if isinstance(extra, Mapping):
            specific.update({k: _token_content(v) for k, v in extra.items()})
        extra_list = [_token_content(t) for t in extra] if isinstance(extra, list) else []
        self._template_tokens = {k: v for k, v in {**named, **specific}.items() if v is not None}
        self._add_config_tokens(
            config.get("added_tokens_decoder") or {},
            list(self._template_tokens.values()) + [t for t in extra_list if t],
        )

        added = backend.get_added_tokens_decoder()
        self._special_ids = frozenset(i for i, t in added.items() if t.special)
        self._byte_ids = frozenset(
            i
            for b in range(256)
            for name in {f"<0x{b:02X}>", f"<0x{b:02x}>"}
            if (i := backend.token_to_id(name)) is not None
        )
        self.bos_token, self.eos_token = named["bos_token"], named["eos_token"]
        self.pad_token, self.unk_token = named["pad_token"], named["unk_token"]
        self._cleanup = bool(config.get("clean_up_tokenization_spaces", False)) and not self._is_bpe
        max_len = config.get("model_max_length")  # transformers saves 1e30 to mean "no limit"
        self.model_max_length = int(max_len) if isinstance(max_len, (int, float)) and max_len < 1e12 else None

        for name, default in GEMMA4_MULTIMODAL_TOKENS.items():  # sets image_token, image_token_id, ...
            token = specific.get(name)
            if token is None and backend.token_to_id(default) is not None:
                token = default
            setattr(self, name, token)
            setattr(self, name + "_id", self._id_or_none(token))

        self.chat_template = dict(chat_template) if isinstance(chat_template, Mapping) else chat_template

    def _add_config_tokens(self, added_tokens_decoder: Mapping[str, Any], special: list[str]) -> None:
        """Register tokens as TokenizersBackend.__init__ does: added_tokens_decoder entries that differ
        from the backend's, then every named/extra special token not yet an added token, as special."""
        existing = self._backend.get_added_tokens_decoder().values()
        present_repr = {repr(t) for t in existing}
        present = {t.content for t in existing}
        to_add: list[AddedToken] = []
        for _, fields in sorted(added_tokens_decoder.items(), key=lambda kv: int(kv[0])):
            if isinstance(fields, Mapping) and isinstance(fields.get("content"), str):
                token = AddedToken(**{k: v for k, v in fields.items() if k != "__type"})
                if repr(token) not in present_repr:
                    to_add.append(token)
                    present.add(token.content)
        for content in special:
            if content not in present:
                to_add.append(AddedToken(content, special=True))
                present.add(content)
        if to_add:
            self._backend.add_tokens(to_add)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> Tokenizer:
        """Load tokenizer.json, tokenizer_config.json and the chat template from ``model_dir``."""
        path = Path(model_dir)
        if not path.is_dir():
            raise ValueError(f"{path}: tokenizer directory does not exist")
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise ValueError(f"{tok_file}: not found; g4serve needs a Hugging Face tokenizer.json")
        try:
            backend = tokenizers.Tokenizer.from_file(str(tok_file))
        except Exception as exc:  # noqa: BLE001 - the tokenizers library raises bare Exceptions
            raise ValueError(f"{tok_file}: not a valid tokenizers file ({exc})") from None
        cfg_file = path / "tokenizer_config.json"
        config = _read_json(cfg_file) if cfg_file.is_file() else {}
        if not isinstance(config, dict):  # a corrupt file, not a caller's type error
            raise ValueError(f"{cfg_file}: expected a JSON object")  # noqa: TRY004
        return cls(backend, config, _load_chat_template(path, config), name_or_path=str(path))

    # ---- vocabulary ----

    @property
    def backend(self) -> tokenizers.Tokenizer:
        return self._backend

    @property
    def vocab_size(self) -> int:
        """Size of the full vocabulary including added tokens (``len(hf_tokenizer)``)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    def get_vocab(self) -> dict[str, int]:
        return self._backend.get_vocab(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id) if token_id >= 0 else None

    def as_text(self, text: str) -> str:
        """``text`` for a prompt as data (a customer's words, a bank's names): every added token's spelling
        in it (``<|turn>``, ``<eos>``, ...) broken by a word joiner (U+2060) after its first character, so
        that encoding it gives text tokens and never a control token. The tokenizer reads those spellings as
        their tokens wherever they stand: a "<turn|>" typed by a customer ends the turn it was written in."""
        if self._markup is None:
            return text
        return self._markup.sub(lambda m: m[0][0] + "\u2060" + m[0][1:], text)

    @functools.cached_property
    def _markup(self) -> re.Pattern | None:
        """The added tokens' spellings that ``as_text`` breaks, longest first (None: there are none)."""
        spellings = sorted(
            {
                t.content
                for t in self._backend.get_added_tokens_decoder().values()
                if len(t.content) >= 2 and not any(c.isspace() for c in t.content)
            },
            key=lambda s: (-len(s), s),
        )
        return re.compile("|".join(map(re.escape, spellings))) if spellings else None

    @property
    def special_token_ids(self) -> frozenset[int]:
        """Ids that ``decode(..., skip_special_tokens=True)`` drops."""
        return self._special_ids

    @property
    def byte_token_ids(self) -> frozenset[int]:
        """Ids of the byte-fallback tokens ``<0x00>``..``<0xFF>``."""
        return self._byte_ids

    @property
    def bos_token_id(self) -> int | None:
        return self._id_or_none(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return self._id_or_none(self.eos_token)

    @property
    def pad_token_id(self) -> int | None:
        return self._id_or_none(self.pad_token)

    @property
    def unk_token_id(self) -> int | None:
        return self._id_or_none(self.unk_token)

    def _id_or_none(self, token: str | None) -> int | None:
        return None if token is None else self._backend.token_to_id(token)

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """Named special tokens (bos_token, ..., image_token, ...) as chat templates see them."""
        return dict(self._template_tokens)

    # ---- encode / decode ----

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``. BOS comes only from tokenizer.json's post-processor: transformers v5 ignores
        ``add_bos_token`` in tokenizer_config.json whenever tokenizer.json exists."""
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [e.ids for e in self._backend.encode_batch(texts, add_special_tokens=add_special_tokens)]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids``; unknown ids are dropped, as in transformers."""
        text = self._backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)
        if self._cleanup:  # transformers only cleans up for non-BPE models
            for a, b in (
                (" .", "."),
                (" ?", "?"),
                (" !", "!"),
                (" ,", ","),
                (" ' ", "'"),
                (" n't", "n't"),
                (" 'm", "'m"),
                (" 's", "'s"),
                (" 've", "'ve"),
                (" 're", "'re"),
            ):
                text = text.replace(a, b)
        return text

    def token_text(self, token_id: int) -> str:
        """``decode([token_id])``, kept: a request with logprobs decodes its token and each of its top
        alternatives at every step, on the engine thread (21 decodes a token at 20 top logprobs, ~1 us each
        on the 2-core CPU: ~1.4 ms a step at 64 such rows); the same ids come back step after step."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self.decode([token_id])
            if self.id_to_token(token_id) is not None:  # only vocabulary ids: the cache is at most its size
                self._token_texts[token_id] = text
        return text

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str | None]:
        return [self.id_to_token(int(i)) for i in ids]

    # ---- chat templates ----

    def get_chat_template(self, chat_template: str | None = None, tools: list | None = None) -> str:
        """The template text: ``chat_template`` may name one of several templates or be a template itself."""
        if isinstance(self.chat_template, dict):
            if chat_template is not None:
                return self.chat_template.get(chat_template, chat_template)
            if tools is not None and "tool_use" in self.chat_template:
                return self.chat_template["tool_use"]
            if "default" in self.chat_template:
                return self.chat_template["default"]
            raise ValueError(
                f"{self.name_or_path}: several chat templates and no default; pass "
                f"chat_template= one of {sorted(self.chat_template)}"
            )
        if chat_template is not None:
            return chat_template
        if self.chat_template is None:
            raise ValueError(
                f"{self.name_or_path}: no chat template (chat_template.jinja or tokenizer_config.json)"
            )
        return self.chat_template

    def apply_chat_template(
        self,
        messages: list[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[Mapping[str, Any]] | None = None,
        *,
        documents: list | None = None,
        chat_template: str | None = None,
        continue_final_message: bool | str = False,
        data_as_text: bool = False,
        **template_kwargs: Any,
    ) -> str:
        """Render one conversation to a prompt string exactly as transformers' ``apply_chat_template(...,
        tokenize=False)``; extra keyword arguments (e.g. ``enable_thinking``) reach the template.
        ``chat_template`` (a template's name or text) is trusted: see ``apply_request_chat_template``.
        ``data_as_text``: every string of the messages, tools and documents goes through ``as_text``, so
        none spells a control token (the template's own markers stay tokens); what transformers renders
        for a conversation that spells none."""
        template = self.get_chat_template(chat_template, tools)
        compiled = cached_chat_template(template)

        def render(variables: dict[str, Any]) -> str:
            return compiled.render(**variables)

        return self._render_chat(
            render,
            template,
            messages,
            add_generation_prompt,
            tools,
            documents,
            continue_final_message,
            template_kwargs,
            data_as_text,
        )

    def apply_request_chat_template(
        self,
        messages: list[Mapping[str, Any]],
        template: str,
        renderer: RequestTemplateRenderer,
        add_generation_prompt: bool = True,
        data_as_text: bool = False,
        **template_kwargs: Any,
    ) -> str:
        """``apply_chat_template`` with an untrusted template (one a request supplied): ``renderer`` renders
        it in its sandboxed worker process under its limits (``ChatTemplateLimitError`` past one)."""

        def render(variables: dict[str, Any]) -> str:
            return renderer.render(template, variables)

        return self._render_chat(
            render,
            template,
            messages,
            add_generation_prompt,
            None,
            None,
            False,
            template_kwargs,
            data_as_text,
        )

    def _render_chat(
        self,
        render: Callable[[dict[str, Any]], str],
        template: str,
        messages: list[Mapping[str, Any]],
        add_generation_prompt: bool,
        tools: list[Mapping[str, Any]] | None,
        documents: list | None,
        continue_final_message: bool | str,
        template_kwargs: Mapping[str, Any],
        data_as_text: bool = False,
    ) -> str:
        if not messages:
            raise ValueError("messages: cannot apply the chat template to an empty conversation")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt are mutually exclusive")
        if tools is not None and not all(isinstance(t, Mapping) for t in tools):
            raise ValueError("tools: each tool must be a JSON-schema dict")
        chat, budget = [], [MAX_TEMPLATE_VALUES]
        text = self.as_text if data_as_text else None
        for i, msg in enumerate(messages):
            if not isinstance(msg, Mapping):
                raise TypeError(f"messages[{i}]: must be a dict, got {type(msg).__name__}")
            chat.append(
                _alias_reasoning(_plain({k: v for k, v in msg.items() if v is not None}, budget, text))
            )
        final = None
        if continue_final_message:
            field = continue_final_message if isinstance(continue_final_message, str) else "content"
            chat, final = self._tag_final_message(chat, field, template)
        kwargs = _plain({**self._template_tokens, **template_kwargs})
        variables = dict(
            messages=chat,
            tools=_plain(tools, budget, text),
            documents=_plain(documents, budget, text),
            add_generation_prompt=add_generation_prompt,
            **kwargs,
        )
        try:
            rendered = render(variables)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template: {exc}") from None
        return rendered if final is None else self._cut_at_tag(rendered, final)

    def encode_chat(
        self,
        messages: list[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[Mapping[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> list[int]:
        """Prompt token ids. The template writes <bos> itself, so no special tokens are added (no double BOS),
        as in transformers' ``apply_chat_template(tokenize=True)``."""
        prompt = self.apply_chat_template(messages, add_generation_prompt, tools, **template_kwargs)
        return self.encode(prompt, add_special_tokens=False)

    @staticmethod
    def _tag_final_message(chat: list[dict], field: str, template: str) -> tuple[list[dict], str]:
        """Mark the end of the final message so rendering can be cut there (transformers' algorithm)."""
        final = chat[-1].get(field)
        if final is None:
            raise ValueError(f'continue_final_message: the final message has no "{field}" to continue')
        fields = [field]
        if field in _REASONING_FIELDS:  # reasoning is copied under several names; tag every copy
            fields = [f for f in _REASONING_FIELDS if chat[-1].get(f) == final]
        if not any(f in template for f in fields):
            raise ValueError(f'continue_final_message: "{field}" is not used by the chat template')
        if isinstance(final, (list, tuple)):
            for block in reversed(final):
                if "text" in block:
                    final, block["text"] = block["text"], block["text"] + _CONTINUE_TAG
                    break
            else:
                raise ValueError("continue_final_message: the final message has no text to continue")
        else:
            for f in fields:
                chat[-1][f] = chat[-1][f] + _CONTINUE_TAG
        return chat, final

    @staticmethod
    def _cut_at_tag(rendered: str, final: str) -> str:
        if final.strip() not in rendered or _CONTINUE_TAG.strip() not in rendered:
            raise ValueError("continue_final_message: the template dropped part of the final message")
        loc = rendered.rindex(_CONTINUE_TAG.strip())
        # A template that trims the message also trimmed the tag's space: then trim what precedes it too.
        spaced = rendered[loc : loc + len(_CONTINUE_TAG)] == _CONTINUE_TAG
        return rendered[:loc] if spaced else rendered[:loc].rstrip()


class IncrementalDetokenizer:
    """Streaming decode: ``add(id)`` returns only newly final text; ``flush()`` returns the rest at the end.

    ``"".join(pieces) + flush() == tokenizer.decode(all_ids, skip_special_tokens)``. Text is held back
    while it could still change: after a byte-fallback token (the decoder turns a whole run of byte tokens
    into one string, or into one U+FFFD per byte if the run is not valid UTF-8, so a later byte can still
    spoil earlier ones) and while it ends in a U+FFFD that may be an unfinished character (byte-level BPE
    splits characters across tokens). A U+FFFD that the last token spells itself is text and goes out.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []  # ids decode() keeps (specials dropped when skipping, unknown ids dropped)
        self._prefix = 0  # window start: already-emitted context that makes the diff below exact
        self._read = 0  # ids before this index have been emitted
        self.token_ids: list[int] = []
        self.text = ""

    def add(self, token_id: int) -> str:
        token_id = int(token_id)
        self.token_ids.append(token_id)
        dropped = self._skip and token_id in self._tok.special_token_ids
        if dropped or self._tok.id_to_token(token_id) is None:
            return ""
        self._ids.append(token_id)
        if token_id in self._tok.byte_token_ids:
            return ""
        return self._emit(final=False)

    def add_many(self, token_ids: Iterable[int]) -> str:
        return "".join(self.add(t) for t in token_ids)

    def flush(self) -> str:
        """Text still held back (an unfinished byte sequence decodes to U+FFFD here, as in decode())."""
        return self._emit(final=True) if self._read < len(self._ids) else ""

    def _emit(self, final: bool) -> str:
        decode = self._tok.decode
        window = decode(self._ids[self._prefix :], self._skip)
        if not final and window.endswith("\ufffd") and not self._last_token_ends_in_fffd():
            return ""
        delta = window[len(decode(self._ids[self._prefix : self._read], self._skip)) :]
        self._prefix, self._read = self._read, len(self._ids)
        self.text += delta
        return delta

    def _last_token_ends_in_fffd(self) -> bool:
        """The trailing U+FFFD is the last token's own character (in its vocab string, so no later token can
        change it), not the decoder's stand-in for bytes that are not (yet) valid UTF-8."""
        return (self._tok.id_to_token(self._ids[-1]) or "").endswith("\ufffd")


__all__ = [
    "GEMMA4_MULTIMODAL_TOKENS",
    "MAX_TEMPLATE_VALUES",
    "ChatTemplateError",
    "IncrementalDetokenizer",
    "Tokenizer",
    "compile_chat_template",
    "set_gemma_pipeline",
]
