"""`make test-latest`: the oracle tests against the newest releases, and which release drifted.

CI installs everything from constraints.txt, so a new release cannot turn it red; this is how we learn,
before moving a pin, what a new release would change. In `.venv-latest` it installs the project with
every pin kept except the oracle set (torch + torchvision, transformers, tokenizers, xgrammar), which take
the index's newest, and runs the tests that compare g4serve with transformers, tokenizers and xgrammar.
When some fail, it puts every floated package back to its pin and moves one at a time to its newest
release, rerunning only the failures: the release that makes them fail alone is the one that drifted.

It reports and exits 0 either way (STRICT=1: exit 1 on drift), and writes .venv-latest/drift.json.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".venv-latest"
PYTHON = VENV / "bin" / "python"
CONSTRAINTS = ROOT / "constraints.txt"
# Released together (torchvision pins one torch; torch pins its triton and CUDA wheels), so they float and
# move as one; the torch group's "nvidia-*" / "cuda-*" members are filled in from constraints.txt.
FLOATED: dict[str, list[str]] = {
    "torch": ["torch", "torchvision", "triton"],
    "transformers": ["transformers"],
    "tokenizers": ["tokenizers"],
    "xgrammar": ["xgrammar"],
}
# The tests whose oracle is one of the floated packages: the model against transformers' Gemma 4, the
# processors, tokenizer and chat template against transformers', constrained decoding against xgrammar.
# TEST_LATEST_TARGETS (space-separated) picks others, e.g. to try the attribution on one file.
ORACLE_TESTS = os.environ.get("TEST_LATEST_TARGETS", "tests/models tests/processing tests/structured").split()


def pins() -> dict[str, str]:
    found = {}
    for line in CONSTRAINTS.read_text().splitlines():
        match = re.match(r"^([A-Za-z0-9_.-]+)==(\S+)", line)
        if match:
            found[match.group(1).lower()] = match.group(2)
    return found


def pip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(PYTHON), "-m", "pip", *args], cwd=ROOT, text=True, capture_output=True)


def installed(name: str) -> str | None:
    out = pip("show", name).stdout
    match = re.search(r"^Version: (\S+)", out, re.M)
    return match.group(1) if match else None


def install(constraints: Path, *args: str, exit_on_error: bool = True) -> bool:
    result = pip("install", "-q", "-c", str(constraints), *args)
    if result.returncode != 0 and exit_on_error:
        sys.exit(f"pip install {' '.join(args)} failed:\n{result.stderr[-3000:]}")
    return result.returncode == 0


def pytest(targets: list[str]) -> tuple[bool, list[str]]:
    """(passed, the failing test ids)."""
    cmd = [str(PYTHON), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rf", *targets]
    result = subprocess.run(cmd, cwd=ROOT, text=True, capture_output=True)
    print(result.stdout.strip().splitlines()[-1] if result.stdout.strip() else result.stderr[-2000:])
    failed = re.findall(r"^FAILED (\S+)", result.stdout, re.M) + re.findall(
        r"^ERROR (\S+)", result.stdout, re.M
    )
    return result.returncode == 0, failed


def requirements(names: list[str]) -> set[str]:
    """The direct requirements of ``names`` as installed in .venv-latest (lower-case)."""
    out = pip("show", *names).stdout
    return {
        r.strip().lower()
        for line in re.findall(r"^Requires: (.*)$", out, re.M)
        for r in line.split(",")
        if r.strip()
    }


def main() -> int:
    pinned = pins()
    FLOATED["torch"] += sorted(p for p in pinned if p.startswith(("nvidia-", "cuda-")))
    floated = [p for group in FLOATED.values() for p in group]
    loose = VENV / "constraints-floated.txt"
    if not PYTHON.exists():
        venv.create(VENV, with_pip=True)
    # The pins without the floated packages: everything else stays as CI has it.
    VENV.mkdir(exist_ok=True)
    loose.write_text(
        "".join(
            line + "\n"
            for line in CONSTRAINTS.read_text().splitlines()
            if not any(re.match(rf"^{re.escape(p)}==", line, re.I) for p in floated)
        )
    )
    install(loose, "--upgrade", "pip", "setuptools")
    args = [
        "--upgrade",
        "--upgrade-strategy",
        "only-if-needed",
        "--no-build-isolation",
        "-e",
        ".[test]",
        *floated,
    ]
    if not install(loose, *args, exit_on_error=False):
        # A newest release needs a newer version of something pinned: float its direct requirements too.
        released = sorted(requirements(floated) & set(pinned) - set(floated))
        print(f"the newest releases need newer requirements; floating their pins too: {', '.join(released)}")
        loose.write_text(
            "".join(
                line + "\n"
                for line in loose.read_text().splitlines()
                if not any(re.match(rf"^{re.escape(p)}==", line, re.I) for p in released)
            )
        )
        install(loose, *args)
    newest = {p: installed(p) for p in floated}
    moved = {p: (pinned.get(p), v) for p, v in newest.items() if v != pinned.get(p)}
    print(f"{'package':14s} {'pinned':10s} newest")
    for name, group in FLOATED.items():
        companions = [p for p in group[1:] if p in moved]
        line = f"{name:14s} {pinned.get(name, '-'):10s} {newest[name]}"
        print(
            line
            + (f"  (+ {len(companions)} companions moved: {', '.join(companions)})" if companions else "")
        )
    report: dict = {"pinned": {p: pinned.get(p) for p in floated}, "newest": newest, "culprits": {}}
    ok, failed = pytest(ORACLE_TESTS)
    report["failed_with_all_newest"] = failed
    if not ok and moved:
        print(f"{len(failed)} failed with the newest releases; moving one package at a time from the pins:")
        install(CONSTRAINTS, *(f"{p}=={pinned[p]}" for p in floated if p in pinned))
        for name, group in FLOATED.items():
            if not any(p in moved for p in group):
                continue
            install(loose, *(f"{p}=={newest[p]}" for p in group if newest[p]))
            alone_ok, alone_failed = pytest(failed)
            report["culprits"][name] = alone_failed
            print(
                f"  {name} {newest[group[0]]} alone: "
                f"{'no failure' if alone_ok else f'{len(alone_failed)} of the failures'}"
            )
            install(CONSTRAINTS, *(f"{p}=={pinned[p]}" for p in group if p in pinned))
    (VENV / "drift.json").write_text(json.dumps(report, indent=2))
    if ok:
        names = [f"{n} {newest[n]}" for n in FLOATED if n in moved]
        print(
            "no drift: the oracle tests pass with the newest releases"
            + (f" ({', '.join(names)})" if names else " (the pins are the newest)")
        )
        return 0
    culprits = [n for n, f in report["culprits"].items() if f]
    print(
        "drift: "
        + (
            ", ".join(f"{n} {newest[FLOATED[n][0]]}" for n in culprits)
            if culprits
            else "only with several new releases together (none fails alone)"
        )
    )
    return 1 if os.environ.get("STRICT") == "1" else 0


if __name__ == "__main__":
    sys.exit(main())
