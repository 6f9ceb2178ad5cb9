"""The engine's command-line flags, made from ``EngineConfig``'s fields (``g4serve.engine.config``).

``add_engine_arguments`` turns the fields into argparse flags named as ``vllm serve`` names them
(``max_num_seqs`` -> ``--max-num-seqs``), with each field's default and help text; ``engine_config_from_args``
turns the parsed flags back into an ``EngineConfig``. ``g4serve serve``, ``g4serve generate``, the bench and
the assistant all take their engine flags from here, so no default is written twice.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import types
import typing
from typing import Any

from g4serve.engine.config import MODALITIES, EngineConfig


def parse_mm_limits(text: str) -> dict[str, int]:
    """``'{"image": 2, "audio": 1}'`` (vLLM's JSON form) or ``image=2,audio=1``; unnamed modalities keep
    their defaults."""
    text = text.strip()
    try:
        raw = (
            json.loads(text)
            if text.startswith("{")
            else dict(kv.split("=", 1) for kv in text.split(",") if kv)
        )
    except (ValueError, json.JSONDecodeError) as exc:
        raise argparse.ArgumentTypeError(f"--limit-mm-per-prompt: cannot parse {text!r}: {exc}") from None
    out = {}
    for key, value in raw.items():
        if key not in MODALITIES:
            raise argparse.ArgumentTypeError(f"--limit-mm-per-prompt: unknown modality {key!r}")
        # A JSON integer or decimal digits: floats (2.7, Infinity) and booleans are refused, not truncated.
        if (
            isinstance(value, bool)
            or not isinstance(value, int | str)
            or not str(value).strip().lstrip("-").isdigit()
        ):
            raise argparse.ArgumentTypeError(f"--limit-mm-per-prompt: {key} must be an integer")
        out[key] = int(value)
        if out[key] < 0:
            raise argparse.ArgumentTypeError(f"--limit-mm-per-prompt: {key} must be >= 0")
    return out


def parse_lora_module(text: str) -> dict[str, str]:
    """One ``--lora-modules`` item: ``name=path`` or vLLM's JSON ``{"name": ..., "path": ...}``."""
    text = text.strip()
    if text.startswith("{"):
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"--lora-modules: cannot parse {text!r}: {exc}") from None
        name, path = (raw.get("name"), raw.get("path")) if isinstance(raw, dict) else (None, None)
    else:
        name, _, path = text.partition("=")
    if not isinstance(name, str) or not isinstance(path, str) or not name.strip() or not path.strip():
        raise argparse.ArgumentTypeError(f"--lora-modules: expected name=path, got {text!r}")
    return {name.strip(): path.strip()}


def parse_json_object(text: str) -> dict:
    """A flag whose value is a JSON object (``--speculative-config``)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


PARSERS = {  # a field's ``parse`` metadata: its flag's argparse type
    "mm_limits": parse_mm_limits,
    "lora_modules": parse_lora_module,
    "json_object": parse_json_object,
}


def _flag_type(name: str) -> type:
    """int / float / str from a field's annotation (``int | None`` -> int)."""
    hint = typing.get_type_hints(EngineConfig)[name]
    if isinstance(hint, types.UnionType):
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    return hint


def engine_fields(exclude: typing.Iterable[str] = ()) -> list[dataclasses.Field]:
    """The fields that have a flag, minus ``exclude``."""
    skip = set(exclude)
    return [f for f in dataclasses.fields(EngineConfig) if f.metadata.get("cli", True) and f.name not in skip]


def add_engine_arguments(
    parser: argparse.ArgumentParser,
    exclude: typing.Iterable[str] = (),
    defaults: dict[str, Any] | None = None,
    notes: dict[str, str] | None = None,
) -> None:
    """One flag per ``EngineConfig`` field (``--max-num-seqs``), its default and help from the field.
    ``defaults``: an application's own defaults for some fields (the help shows them), ``notes``: why."""
    group = parser.add_argument_group("engine")
    defaults, notes = defaults or {}, notes or {}
    for f in engine_fields(exclude):
        flag = "--" + f.name.replace("_", "-")
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        default = defaults.get(f.name, default)
        shown = json.dumps(default) if isinstance(default, dict) else default
        help_text = f.metadata["help"]
        if f.name in defaults:  # the application's default replaces the one the field's help names
            help_text = help_text.split(" (default")[0]
        help_text += f"; {notes[f.name]}" if f.name in notes else ""
        if default is not None and "default" not in help_text:
            help_text += f" (default: {shown})"
        if _flag_type(f.name) is bool:
            # --x / --no-x for options on by default (vLLM's --no-enable-prefix-caching) or decided by the
            # engine (None), --x for the others
            action = "store_true" if default is False else argparse.BooleanOptionalAction
            group.add_argument(flag, action=action, default=default, help=help_text)
        elif "parse" in f.metadata:
            group.add_argument(
                flag,
                type=PARSERS[f.metadata["parse"]],
                default=None,
                help=help_text,
                **({"nargs": f.metadata["nargs"], "action": "extend"} if "nargs" in f.metadata else {}),
            )
        else:
            group.add_argument(
                flag,
                type=_flag_type(f.name),
                default=default,
                choices=f.metadata.get("choices"),
                help=help_text,
            )


def engine_config_from_args(args: argparse.Namespace, **overrides: Any) -> EngineConfig:
    """The ``EngineConfig`` of parsed flags; ``overrides`` (e.g. ``model``) win. A parsed
    ``--limit-mm-per-prompt`` is merged into the default limits (unnamed modalities keep theirs)."""
    values = {f.name: getattr(args, f.name) for f in engine_fields() if hasattr(args, f.name)}
    limits = values.pop("limit_mm_per_prompt", None)
    modules = values.pop("lora_modules", None)  # one dict per name=path item
    if modules:
        values["lora_modules"] = {name: path for item in modules for name, path in item.items()}
    config = EngineConfig(**{**values, **overrides})
    if limits and not config.text_only:
        config.limit_mm_per_prompt = {**config.limit_mm_per_prompt, **limits}
    return config


__all__ = [
    "add_engine_arguments",
    "engine_config_from_args",
    "engine_fields",
    "parse_lora_module",
    "parse_mm_limits",
]
