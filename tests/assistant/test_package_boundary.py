"""The assistant is a separate package on the engine's public surface: ``g4serve_assistant`` imports only the
listed names of ``g4serve``, calls only ``AsyncLLMEngine``'s public members, and the engine and server import
neither the assistant nor its extra's libraries."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import g4serve
import g4serve_assistant

ASSISTANT_SRC = Path(g4serve_assistant.__file__).parent
ENGINE_SRC = Path(g4serve.__file__).parent

# Every g4serve name the assistant may import, by module. Each is part of what an application built on the
# engine is meant to use:
ALLOWED_IMPORTS: dict[str, set[str]] = {
    # the asyncio engine: the assistant's one handle on the model
    "g4serve.engine.async_engine": {"AsyncLLMEngine"},
    # the request options of `generate` / `validate`, and the constrained-output spec they carry
    "g4serve.sampling_params": {"SamplingParams"},
    "g4serve.structured": {"StructuredSpec"},
    # the engine's CLI flags, made from EngineConfig as for `g4serve serve`
    "g4serve.engine_args": {"add_engine_arguments", "engine_config_from_args"},
    # the cache directory every g4serve command shares
    "g4serve.tiny": {"cache_dir"},
    # the error, health and JSON-body helpers every g4serve app answers with (one error shape, docs/api.md)
    "g4serve.server.errors": {
        "APIError",
        "error_response",
        "health_response",
        "install_error_handlers",
        "read_json_object",
        "valid_text",
    },
    # the limits on request bodies the API server and the routers keep (a cap, a budget over the bodies held
    # at once, a deadline), their flags and the middleware that enforces them: one definition for every app
    "g4serve.server.body_budget": {
        "BodyBudget",
        "BodyLimits",
        "add_body_limit_arguments",
        "body_limits_from_args",
    },
    "g4serve.server.guard": {"BodyLimitsMiddleware"},
    # band-limited resampling to 16 kHz: a pure function (array in, array out), no engine state
    "g4serve.processing.audio": {"resample"},
    # the server's media limits: the assistant's WAV parser takes the same sample-rate bounds
    "g4serve.processing.limits": {"MediaLimits"},
    # a model's config, read without its weights: whether it has the audio tower `--asr gemma` needs
    "g4serve.config": {"Gemma4Config", "preset"},
}
# What the assistant may touch on an AsyncLLMEngine (an `engine` variable or attribute, or the class).
ENGINE_SURFACE = {"from_config", "process", "generate", "validate", "tokenizer", "shutdown", "dead"}
# Import names of the `assistant` extra's distributions.
EXTRA_MODULES = {"rapidfuzz", "jellyfish", "text_to_num", "silero_vad", "pocketsphinx", "websockets"}


def _modules(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)


def _parse(path: Path) -> ast.Module:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            child.parent = node  # type: ignore[attr-defined]
    return tree


def _imports(path: Path, root: Path) -> list[tuple[ast.AST, str, str | None]]:
    """(node, absolute module, name) of every import in ``path`` (a module of the package at ``root``);
    ``name`` None for ``import module``."""
    package = list(path.relative_to(root.parent).parts[:-1])  # the package `from .x import y` starts in
    found: list[tuple[ast.AST, str, str | None]] = []
    for node in ast.walk(_parse(path)):
        if isinstance(node, ast.Import):
            found += [(node, alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            found += [(node, module, alias.name) for alias in node.names]
    return found


def _root(module: str) -> str:
    return module.partition(".")[0]


def _in_function(node: ast.AST) -> bool:
    while (node := getattr(node, "parent", None)) is not None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            return True
    return False


def test_the_assistant_imports_only_the_public_engine_names():
    used: dict[str, set[str]] = {}
    bad = []
    for path in _modules(ASSISTANT_SRC):
        for node, module, name in _imports(path, ASSISTANT_SRC):
            if _root(module) != "g4serve":
                continue
            where = f"{path.relative_to(ASSISTANT_SRC)}:{node.lineno}"
            if name is None or name not in ALLOWED_IMPORTS.get(module, set()):
                bad.append(f"{where}: {module}{'' if name is None else f'.{name}'}")
            else:
                used.setdefault(module, set()).add(name)
    assert not bad, "the assistant imports engine internals:\n" + "\n".join(bad)
    # Every entry is in use, so the list stays the assistant's own.
    unused = {m: names - used.get(m, set()) for m, names in ALLOWED_IMPORTS.items()}
    assert not {m: names for m, names in unused.items() if names}


def test_the_assistant_uses_only_public_async_engine_members():
    from g4serve.engine.async_engine import AsyncLLMEngine

    touched: dict[str, list[str]] = {}
    for path in _modules(ASSISTANT_SRC):
        for node in ast.walk(_parse(path)):
            if not isinstance(node, ast.Attribute):
                continue
            owner = node.value
            is_engine = (isinstance(owner, ast.Name) and owner.id in ("engine", "AsyncLLMEngine")) or (
                isinstance(owner, ast.Attribute) and owner.attr == "engine"
            )
            if is_engine:
                touched.setdefault(node.attr, []).append(f"{path.name}:{node.lineno}")
    outside = {attr: where for attr, where in touched.items() if attr not in ENGINE_SURFACE}
    assert not outside, f"the assistant reaches past AsyncLLMEngine's public members: {outside}"
    assert {"process", "generate", "validate", "tokenizer"} <= set(touched)
    for attr in ENGINE_SURFACE:  # each is public on AsyncLLMEngine (`dead` is set in __init__)
        assert not attr.startswith("_")
        assert hasattr(AsyncLLMEngine, attr) or attr in AsyncLLMEngine.__init__.__code__.co_names, attr


def test_the_engine_imports_the_assistant_only_lazily_in_its_cli():
    bad = []
    for path in _modules(ENGINE_SRC):
        rel = path.relative_to(ENGINE_SRC).as_posix()
        for node, module, _name in _imports(path, ENGINE_SRC):
            root = _root(module)
            if root in EXTRA_MODULES:
                bad.append(f"{rel}:{node.lineno}: imports {module} (the assistant extra's)")
            elif root == "g4serve_assistant" and not (rel == "cli.py" and _in_function(node)):
                bad.append(f"{rel}:{node.lineno}: imports {module} at module level or outside cli.py")
    assert not bad, "\n".join(bad)


def test_importing_the_server_and_the_offline_api_loads_neither_the_assistant_nor_its_extra():
    code = (
        "import json, sys\n"
        "import g4serve.server.app, g4serve.server.launch, g4serve.llm, g4serve.cli\n"
        f"roots = {sorted(EXTRA_MODULES | {'g4serve_assistant'})!r}\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.partition('.')[0] in roots)))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []
