"""``g4serve assistant`` is registered lazily from the separate ``g4serve_assistant`` package; without the
``assistant`` extra (or without the package) it exits 2 with one line saying what to install, and
``g4serve-assistant`` is the same command."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from g4serve.cli import build_parser, main

HINT = "the assistant needs its extra: pip install 'g4serve[assistant]'"


def test_the_assistant_subcommand_comes_from_the_assistant_package(capsys):
    args = build_parser().parse_args(["assistant", "--no-llm", "--port", "9000"])
    from g4serve_assistant.cli import run

    assert args.func is run and args.no_llm and args.port == 9000
    with pytest.raises(SystemExit) as exit_info:
        main(["assistant", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: g4serve assistant") and "--no-llm" in out and "import-payees" in out
    for argv in (["assistant", "--no-such-flag"], ["make-tiny", "/tmp/x", "--no-such-flag"]):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2
        assert "unrecognized arguments: --no-such-flag" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv", [["assistant", "--no-llm", "--db", ":memory:"], ["assistant", "import-payees", "x.csv"]]
)
def test_without_the_extra_the_assistant_exits_2_with_the_install_hint(monkeypatch, capsys, argv):
    for name in ("rapidfuzz", "pocketsphinx"):
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed: find_spec and import both fail
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == f"g4serve assistant: error: {HINT} (missing: rapidfuzz, pocketsphinx)\n"


def test_without_the_assistant_package_the_other_commands_still_work(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "g4serve_assistant", None)
    monkeypatch.delitem(sys.modules, "g4serve_assistant.cli", raising=False)
    assert build_parser().parse_args(["make-tiny", "/tmp/x"]).dir == "/tmp/x"
    assert main(["assistant", "--port", "9000", "--no-llm"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"g4serve assistant: error: {HINT} (missing: g4serve_assistant")
    assert err.count("\n") == 1 and "Traceback" not in err


def _script(name: str) -> str:
    path = Path(sys.executable).parent / name
    if not path.exists():
        pytest.skip(f"{name} is not installed next to {sys.executable} (pip install -e .)")
    return str(path)


def test_the_g4serve_assistant_console_script(tmp_path):
    script = _script("g4serve-assistant")
    proc = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0 and proc.stdout.startswith("usage: g4serve-assistant")
    assert "--no-llm" in proc.stdout and "import-payees" in proc.stdout
    missing = tmp_path / "missing.csv"
    proc = subprocess.run(
        [script, "import-payees", str(missing), "--db", str(tmp_path / "bank.db")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2 and proc.stderr == f"g4serve-assistant: error: {missing}: no such file\n"


def test_the_console_script_without_the_extra_in_a_subprocess():
    """End to end, as a venv without the extra runs it: exit 2, one line on stderr, no traceback."""
    code = (
        "import sys\n"
        "sys.modules['silero_vad'] = None\n"
        "from g4serve_assistant.cli import main\n"
        "sys.exit(main(['--no-llm']))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == f"g4serve-assistant: error: {HINT} (missing: silero_vad)\n"
