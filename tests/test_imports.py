"""The import graph of ``src/g4serve``: no cycles, and no upward imports between its layers.

Every module is parsed with ``ast`` (nothing is imported), and every import statement counts: at module
level, inside functions and under ``if TYPE_CHECKING:`` alike, since a deferred import still ties the two
modules together (a function-level import is how a cycle usually hides). Relative imports are resolved;
``from g4serve.x import y`` is an edge to the module ``g4serve.x.y`` when that is a module, else to
``g4serve.x``. Importing a submodule is not counted as importing its parent package's ``__init__``.

The layering, bottom to top: kernels < layers < models < engine < server / bench, with processing,
structured and lora beside the model stack. A rule below that fails names the import and its line: move the
thing to the layer it belongs to rather than adding an exception.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "g4serve"


@dataclass(frozen=True)
class LayerRule:
    importer: str  # modules at or under this dotted name...
    forbidden: tuple[str, ...]  # ...import nothing at or under these
    why: str


LAYER_RULES = (
    # Kernels are the bottom: one op per file beside its torch reference, tested on bare tensors. What a
    # kernel needs from above (metadata, the KV cache) it takes as tensors and ints, so kernels build and test
    # with torch and triton alone, and a change in a layer, model or the engine never reaches them.
    LayerRule(
        "g4serve.kernels",
        (
            "g4serve.layers",
            "g4serve.engine",
            "g4serve.models",
            "g4serve.server",
            "g4serve.processing",
            "g4serve.structured",
            "g4serve.bench",
        ),
        "kernels are the bottom layer",
    ),
    # Layers are the models' building blocks (attention backends and their metadata, norms, MoE, sampler). The
    # engine owns the KV cache and hands it down; the backends see it through the ``KVTensors`` protocol.
    LayerRule(
        "g4serve.layers",
        ("g4serve.engine", "g4serve.models", "g4serve.server", "g4serve.bench"),
        "layers sit below the models that compose them and the engine that drives them",
    ),
    # Tensor parallel's group (collectives) and shard rules are used by the model to build and run a rank's
    # shard; the processes that hold the ranks are the engine's (``engine.tensor_parallel``).
    LayerRule(
        "g4serve.distributed",
        (
            "g4serve.layers",
            "g4serve.models",
            "g4serve.engine",
            "g4serve.server",
            "g4serve.bench",
            "g4serve.deploy",
        ),
        "the tensor-parallel group and shard rules sit below the model; the rank processes are the engine's",
    ),
    # A model is a forward over a flat token batch and its attention metadata: loading, parity tests and the
    # tiny model use it without an engine; scheduling, caching and serving drive it from above.
    LayerRule(
        "g4serve.models",
        ("g4serve.engine", "g4serve.server", "g4serve.bench"),
        "models sit below the engine that runs them",
    ),
    # LoRA adapters are read, checked and given slots of the decoder's stacked weights (``layers.lora``)
    # without an engine; the engine loads them at start or between steps, and the server names them.
    LayerRule(
        "g4serve.lora",
        ("g4serve.engine", "g4serve.models", "g4serve.server", "g4serve.bench"),
        "adapters are an input of the engine, below it, and only need the config and the layers",
    ),
    # The engine serves ``LLM`` (offline) and the HTTP server alike; the server and the bench are its clients.
    LayerRule(
        "g4serve.engine",
        ("g4serve.server", "g4serve.bench", "g4serve.deploy"),
        "the engine sits below its clients, the server and the bench (and the replicas' deployment)",
    ),
    # Prompts and media become token ids and encoder inputs before the engine sees them (in worker threads,
    # without a model), so processing depends on the config and the tokenizer only.
    LayerRule(
        "g4serve.processing",
        ("g4serve.engine", "g4serve.server", "g4serve.models", "g4serve.bench"),
        "processing runs before and apart from the engine and the model",
    ),
    # Structured outputs (grammars, token bitmasks) are built from requests and the tokenizer and applied by
    # the engine's sampler step: they are an input of the engine, never a user of it.
    LayerRule(
        "g4serve.structured",
        ("g4serve.engine", "g4serve.server", "g4serve.models", "g4serve.bench"),
        "structured outputs are an input of the engine, below it",
    ),
    # The bench is a client of the server (it starts one, sends it load and scrapes its metrics); the server
    # must not depend on its own load generator.
    LayerRule("g4serve.server", ("g4serve.bench",), "the server sits below the bench that loads it"),
    # Scale-out runs servers as replicas behind a router: the router speaks HTTP to them, the Ray app wraps
    # the server's app; the server never knows it is a replica.
    LayerRule("g4serve.server", ("g4serve.deploy",), "a replica's server does not depend on its deployment"),
    # The environment variables are read by every layer, kernels included: their table imports nothing of
    # g4serve, so it is below everything.
    LayerRule("g4serve.envs", ("g4serve",), "the environment variables' table is the bottom of the package"),
)

# The voice assistant is a separate package layered on top of g4serve (it uses g4serve's engine and server).
# g4serve only launches it, from ``g4serve assistant``: an import inside a function body of ``g4serve.cli``,
# so that g4serve imports and installs without the assistant's extra dependencies.
ASSISTANT_PACKAGE = "g4serve_assistant"
ASSISTANT_LAUNCHER = "g4serve.cli"

# (importer module, imported module) -> why that upward import is allowed. None today: keep it that way by
# moving code to its proper home; an entry that no longer matches an import fails the test.
EXCEPTIONS: dict[tuple[str, str], str] = {}


# ---- the checker -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Import:
    importer: str
    target: str  # dotted module name (for g4serve, a module that exists; outside it, as written)
    line: int
    in_function: bool


def find_modules(src: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` under ``src/package`` (a package is its ``__init__``)."""
    modules = {}
    for path in sorted((src / package).rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _existing(name: str, modules: dict[str, Path]) -> str:
    """The longest prefix of ``name`` that is a known module (``name`` itself when none is)."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return name


def _imports_of_node(module: str, is_package: bool, node: ast.AST, modules: dict[str, Path]) -> list[str]:
    if isinstance(node, ast.Import):
        return [_existing(alias.name, modules) for alias in node.names]
    assert isinstance(node, ast.ImportFrom)
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    out = []
    for alias in node.names:
        submodule = f"{source}.{alias.name}"
        out.append(submodule if submodule in modules else _existing(source, modules))
    return out


def collect_imports(modules: dict[str, Path], sources: dict[str, str] | None = None) -> list[Import]:
    """Every import statement of every module (``sources``: module -> text, instead of reading the files)."""
    found = []
    for module, path in modules.items():
        text = sources[module] if sources is not None else path.read_text()
        is_package = path.name == "__init__.py"

        def visit(node: ast.AST, in_function: bool, module=module, is_package=is_package) -> None:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _imports_of_node(module, is_package, node, modules):
                    found.append(Import(module, target, node.lineno, in_function))
            nested = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            for child in ast.iter_child_nodes(node):
                visit(child, nested)

        visit(ast.parse(text, filename=str(path)), False)
    return found


def import_graph(imports: list[Import], package: str) -> dict[str, set[str]]:
    """Module -> the modules of ``package`` it imports (a module importing itself is no edge)."""
    graph: dict[str, set[str]] = {}
    for imp in imports:
        graph.setdefault(imp.importer, set())
        if _within(imp.target, package) and imp.target != imp.importer:
            graph[imp.importer].add(imp.target)
    return graph


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        for w in graph.get(todo.pop(), ()):
            if w not in seen:
                seen.add(w)
                todo.append(w)
    return seen


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle ``[a, b, ..., a]`` per strongly connected component with more than one module.

    Reachability from every module (a few hundred at most): v is on a cycle when it reaches itself, and its
    component is what it reaches that reaches it back.
    """
    reach = {v: _reachable(graph, v) for v in graph}
    components = {frozenset(w for w in reach[v] if v in reach.get(w, ())) for v in graph if v in reach[v]}
    return sorted(_cycle_through(min(c), set(c), graph) for c in components)


def _cycle_through(start: str, component: set[str], graph: dict[str, set[str]]) -> list[str]:
    """The shortest path start -> ... -> start inside ``component`` (breadth first)."""
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for v in frontier:
            for w in sorted(graph.get(v, ()) & component):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [*reversed(path), start]
                if w not in parents:
                    parents[w] = v
                    following.append(w)
        frontier = following
    raise AssertionError(f"{start} is on no cycle of its component")


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def upward_imports(
    imports: list[Import], rules: tuple[LayerRule, ...], exceptions: dict[tuple[str, str], str]
) -> list[str]:
    """A line per import that breaks a rule and is not an exception (once per statement and target)."""
    out = []
    for imp in imports:
        if (imp.importer, imp.target) in exceptions:
            continue
        for rule in rules:
            if _within(imp.importer, rule.importer) and any(_within(imp.target, f) for f in rule.forbidden):
                out.append(f"{imp.importer}:{imp.line} imports {imp.target} ({rule.why})")
    return list(dict.fromkeys(out))


def assistant_imports(imports: list[Import], package: str, launcher: str) -> list[str]:
    """A line per import of ``package`` other than inside a function body of ``launcher``."""
    found = [
        f"{imp.importer}:{imp.line} imports {imp.target}"
        + (" at module level" if imp.importer == launcher else "")
        for imp in imports
        if _within(imp.target, package) and not (imp.importer == launcher and imp.in_function)
    ]
    return list(dict.fromkeys(found))


# ---- the package -------------------------------------------------------------------------------------------
MODULES = find_modules(SRC, PACKAGE)
IMPORTS = collect_imports(MODULES)


def test_the_graph_is_the_package():
    """A parser that found nothing would pass every rule: check it sees known modules and edges."""
    graph = import_graph(IMPORTS, PACKAGE)
    assert len(MODULES) > 50 and sum(len(v) for v in graph.values()) > 100
    assert "g4serve.kernels.paged_decode" in graph["g4serve.layers.attention.triton_backend"]
    assert "g4serve.engine.kv_cache" in graph["g4serve.engine.engine"]
    assert "g4serve.layers.attention" in graph["g4serve.engine.model_runner"]


def test_no_import_cycles():
    cycles = find_cycles(import_graph(IMPORTS, PACKAGE))
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_no_upward_imports():
    violations = upward_imports(IMPORTS, LAYER_RULES, EXCEPTIONS)
    assert not violations, "upward imports:\n" + "\n".join(violations)


def test_exceptions_are_still_needed():
    present = {(imp.importer, imp.target) for imp in IMPORTS}
    stale = [f"{a} -> {b}: {why}" for (a, b), why in EXCEPTIONS.items() if (a, b) not in present]
    assert not stale, "exceptions matching no import (remove them):\n" + "\n".join(stale)


def test_the_assistant_is_imported_only_by_the_cli_launcher():
    violations = assistant_imports(IMPORTS, ASSISTANT_PACKAGE, ASSISTANT_LAUNCHER)
    assert not violations, f"imports of {ASSISTANT_PACKAGE}:\n" + "\n".join(violations)


# ---- the checker can fail ----------------------------------------------------------------------------------
def _synthetic(sources: dict[str, str]) -> tuple[dict[str, Path], list[Import]]:
    """Modules from dotted name -> source, nothing on disk (``pkg.sub.__init__``: the package ``pkg.sub``)."""
    modules, texts = {}, {}
    for name, text in sources.items():
        dotted = name.removesuffix(".__init__")
        parts = dotted.split(".")
        is_package = name.endswith(".__init__")
        modules[dotted] = (
            Path("/synthetic", *parts, "__init__.py")
            if is_package
            else Path("/synthetic", *parts[:-1], parts[-1] + ".py")
        )
        texts[dotted] = text
    return modules, collect_imports(modules, texts)


def test_checker_resolves_relative_function_level_and_from_imports():
    modules, imports = _synthetic(
        {
            "pkg.__init__": "from pkg.low import helper\n",
            "pkg.low.__init__": "from .ops import add\n",
            "pkg.low.ops": "import torch\n\ndef add():\n    from ..high import engine\n",
            "pkg.high": "from pkg import low\nfrom pkg.low import ops, thing\nimport pkg.low.ops as o\n",
            "pkg.ext": "def launch():\n    import other_pkg.cli\n",
        }
    )
    graph = import_graph(imports, "pkg")
    assert graph["pkg"] == {"pkg.low"}  # a name from a package: the package's __init__
    assert graph["pkg.low"] == {"pkg.low.ops"}  # relative, to a submodule
    assert graph["pkg.low.ops"] == {"pkg.high"}  # two levels up, inside a function; torch is outside pkg
    assert graph["pkg.high"] == {"pkg.low", "pkg.low.ops"}
    (inner,) = [imp for imp in imports if imp.importer == "pkg.low.ops" and imp.target == "pkg.high"]
    assert inner.in_function and inner.line == 4
    outside = [(i.target, i.in_function) for i in imports if i.importer == "pkg.ext"]
    assert outside == [("other_pkg.cli", True)]


def test_checker_reports_cycles():
    graph = {"p.a": {"p.b"}, "p.b": {"p.c"}, "p.c": {"p.a", "p.d"}, "p.d": set(), "p.e": {"p.d"}}
    assert find_cycles(graph) == [["p.a", "p.b", "p.c", "p.a"]]
    two = {"p.x": {"p.y"}, "p.y": {"p.x"}, "p.a": {"p.b"}, "p.b": {"p.a"}}
    assert find_cycles(two) == [["p.a", "p.b", "p.a"], ["p.x", "p.y", "p.x"]]
    assert find_cycles({"p.a": {"p.b"}, "p.b": set()}) == []
    # and through the parser: a cycle hidden in a function-level import
    _, imports = _synthetic({"pkg.a": "from pkg import b\n", "pkg.b": "def f():\n    import pkg.a\n"})
    assert find_cycles(import_graph(imports, "pkg")) == [["pkg.a", "pkg.b", "pkg.a"]]


def test_checker_reports_upward_imports():
    _, imports = _synthetic(
        {
            "g4serve.kernels.op": "from g4serve.layers.attention import AttentionMetadata\n",
            "g4serve.layers.__init__": "",
            "g4serve.layers.attention": "from g4serve.kernels import op\n",
            "g4serve.engine.run": "def f():\n    from g4serve.server import app\n",
            "g4serve.server.app": "",
        }
    )
    rules = (
        LayerRule("g4serve.kernels", ("g4serve.layers",), "kernels at the bottom"),
        LayerRule("g4serve.engine", ("g4serve.server",), "engine below server"),
    )
    assert upward_imports(imports, rules, {}) == [
        "g4serve.kernels.op:1 imports g4serve.layers.attention (kernels at the bottom)",
        "g4serve.engine.run:2 imports g4serve.server.app (engine below server)",
    ]
    allowed = {("g4serve.engine.run", "g4serve.server.app"): "a reason"}
    assert len(upward_imports(imports, rules, allowed)) == 1
    # a prefix only matches whole dotted names: g4serve.layers_extra is not g4serve.layers
    _, imports = _synthetic({"g4serve.kernels.op": "import g4serve.layers_extra\n"})
    assert upward_imports(imports, rules, {}) == []


def test_checker_reports_assistant_imports():
    _, imports = _synthetic(
        {
            "g4serve.cli": (
                "import g4serve_assistant\n\ndef run():\n    from g4serve_assistant.cli import main\n"
            ),
            "g4serve.server.app": "def f():\n    import g4serve_assistant.app\n",
        }
    )
    assert assistant_imports(imports, "g4serve_assistant", "g4serve.cli") == [
        "g4serve.cli:1 imports g4serve_assistant at module level",
        "g4serve.server.app:2 imports g4serve_assistant.app",
    ]
