"""Load a script of bench/ (not a package) as a module, for the tests of bench/'s scripts."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[2] / "bench"


def load_script(name: str) -> ModuleType:
    """``bench/<name>.py`` as a module; bench/ is on sys.path while it loads (scripts import each other)."""
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while the script runs
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCH))
