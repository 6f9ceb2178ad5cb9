"""Where ``g4serve.deploy`` sits: on top of the server it replicates. Its routing policy (``affinity``,
``router``) is pure Python that the HTTP proxy, the Ray request router and the tests share; only the CLI
imports the package; and Ray is imported by the Ray application alone, so ``g4serve`` runs without it."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "g4serve"
POLICY = ("affinity", "router")


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_the_policy_imports_only_the_standard_library_and_itself():
    for name in POLICY:
        for module in imported_modules(SRC / "deploy" / f"{name}.py"):
            top = module.split(".")[0]
            allowed = top in sys.stdlib_module_names or module in {f"g4serve.deploy.{p}" for p in POLICY}
            assert allowed or module == "__future__", f"deploy/{name}.py imports {module}"


def test_only_the_cli_imports_the_deploy_package():
    for path in SRC.rglob("*.py"):
        relative = path.relative_to(SRC)
        if relative.parts[0] == "deploy" or relative == Path("cli.py"):
            continue
        assert not any(m.startswith("g4serve.deploy") for m in imported_modules(path)), relative


def test_only_the_ray_application_imports_ray():
    for path in (SRC / "deploy").glob("*.py"):
        if path.name == "ray_app.py":
            continue
        assert not any(m.split(".")[0] == "ray" for m in imported_modules(path)), path.name
