"""``g4serve.envs``: every ``G4SERVE_*`` variable the package reads is declared there and read through it,
the table in docs/api.md is the declared one, and values outside a variable's choices are refused by name."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from g4serve import envs

ROOT = Path(__file__).resolve().parents[1]
NAME = re.compile(r"G4SERVE_[A-Z0-9_]+")


def _sources():
    yield from (ROOT / "src" / "g4serve").rglob("*.py")
    yield from (ROOT / "bench").glob("*.py")


def test_every_variable_the_sources_name_is_declared_and_read_through_envs():
    declared = {v.name for v in envs.VARIABLES}
    named = set()
    for path in _sources():
        if path.name == "envs.py":
            continue
        text = path.read_text()
        named |= set(NAME.findall(text))
        assert not re.search(r"environ(\.get)?[\[(]\s*\"G4SERVE_", text), f"{path}: read it with envs.get"
    assert named == declared, f"undeclared: {named - declared}; declared but never named: {declared - named}"


def test_docs_table_lists_the_declared_variables():
    text = (ROOT / "docs" / "api.md").read_text()
    section = text.split("## Environment variables", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `G4SERVE_")]
    documented = [re.match(r"\| `([A-Z0-9_]+)` \| ([^|]+) \|", row).groups() for row in rows]
    declared = [(v.name, f"`{v.default}`" if v.default is not None else "unset") for v in envs.VARIABLES]
    assert [(name, default.strip()) for name, default in documented] == declared


def test_defaults_and_refusals(monkeypatch):
    from g4serve.kernels.gemv import DOT_MAX_ROWS

    monkeypatch.delenv("G4SERVE_MOE_ALIGN", raising=False)
    monkeypatch.delenv("G4SERVE_SKINNY_MAX_ROWS", raising=False)
    assert envs.get("G4SERVE_MOE_ALIGN") == "parallel"
    assert envs.get_int("G4SERVE_SKINNY_MAX_ROWS") == DOT_MAX_ROWS  # the kernel's own row bound
    monkeypatch.setenv("G4SERVE_MOE_ALIGN", "bogus")
    with pytest.raises(ValueError, match="G4SERVE_MOE_ALIGN: expected one of sort, parallel"):
        envs.get("G4SERVE_MOE_ALIGN")
    monkeypatch.setenv("G4SERVE_MOE_W8A8_MIN", "many")
    with pytest.raises(ValueError, match="G4SERVE_MOE_W8A8_MIN: expected an integer"):
        envs.get_int("G4SERVE_MOE_W8A8_MIN")
    monkeypatch.setenv("G4SERVE_TP_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="G4SERVE_TP_TIMEOUT_S: expected a number"):
        envs.get_float("G4SERVE_TP_TIMEOUT_S")
    with pytest.raises(KeyError):
        envs.get("G4SERVE_NOT_A_VARIABLE")


def test_results_record_the_switches_but_not_the_secrets(monkeypatch):
    monkeypatch.setenv("G4SERVE_API_KEY", "sk-very-secret")
    monkeypatch.setenv("G4SERVE_INT4_MATMUL", "tinygemm")
    monkeypatch.delenv("G4SERVE_TP_ONE_DEVICE", raising=False)
    values = envs.recorded()
    assert values["G4SERVE_INT4_MATMUL"] == "tinygemm"  # set
    assert values["G4SERVE_DECODE_TAIL"] == "0"  # its default
    assert "G4SERVE_API_KEY" not in values and "sk-very-secret" not in values.values()
    assert "G4SERVE_TP_ONE_DEVICE" not in values  # unset, no default
    from g4serve.bench.meta import result_header

    assert result_header("x")["switches"] == values
