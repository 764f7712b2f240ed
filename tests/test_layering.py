"""The layering of docs/architecture.md, enforced: read every module's imports with `ast` (imports inside
functions included) and fail on an import up a layer, sideways between two units of one layer (the
executors simulate, memory.allocator_replay and runtime among them), from a module no layer names, or on any
import cycle between modules. And what each layer may not import at all: the library neither Hydra nor
MLflow, its core not torch."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ROOTS = ("slackswap", "pipelines", "tools", "benchmarks", "hydra_plugins")


def _layers() -> list[tuple[int, list[tuple[str, ...]]]]:
    """(layer number, units) from the table between the layer markers of docs/architecture.md."""
    text = (REPO / "docs" / "architecture.md").read_text()
    block = re.search(r"<!-- layers: begin.*?-->(.*?)<!-- layers: end -->", text, re.S)
    assert block, "docs/architecture.md has no layer table between the layer markers"
    layers = []
    for line in block.group(1).strip().splitlines()[2:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        number = int(cells[0].split()[0])
        units = [tuple(re.findall(r"`([\w.]+)`", unit)) for unit in cells[1].split(", ")]
        layers.append((number, units))
    return layers


def _modules() -> dict[str, Path]:
    found = {}
    for root in ROOTS:
        for path in (REPO / root).rglob("*.py"):
            parts = path.relative_to(REPO).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the project modules it imports (`from a import b` names module `a.b` when it is one)."""
    edges: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                wanted = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                wanted = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                          for a in node.names]  # fmt: skip
            else:
                continue
            for target in wanted:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    targets.add(target)
        edges[name] = targets
    return edges


@functools.cache
def _project_imports() -> tuple[dict[str, Path], dict[str, frozenset[str]]]:
    """`_modules()` and their `_imports`, parsed once for the tests that read them (nothing writes the
    tree while the suite runs); frozensets, so no test can change what another reads."""
    modules = _modules()
    return modules, {m: frozenset(t) for m, t in _imports(modules).items()}


def _placement(layers) -> dict[str, tuple[int, int]]:
    """Module prefix -> (layer, unit index)."""
    return {prefix: (number, u) for number, units in layers for u, unit in enumerate(units) for prefix in unit}


def _place(module: str, placement: dict[str, tuple[int, int]]) -> tuple[int, int] | None:
    best = None
    for prefix, where in placement.items():
        if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > len(best[0])):
            best = (prefix, where)
    return None if best is None else best[1]


def test_the_layer_table_parses_and_names_the_executors_as_one_layer() -> None:
    layers = dict(_layers())
    executors = {unit for unit in layers[3]}
    assert {("slackswap.simulate",), ("slackswap.memory.allocator_replay",), ("slackswap.runtime",)} <= executors
    assert sorted(layers) == list(range(8))


def test_every_import_runs_down_the_layers_and_never_sideways() -> None:
    modules, edges = _project_imports()
    placement = _placement(_layers())
    broken, unplaced = [], []
    for module, targets in sorted(edges.items()):
        where = _place(module, placement)
        if where is None:
            if targets & {m for m in modules if m.startswith(("slackswap", "pipelines"))}:
                unplaced.append(module)
            continue
        for target in sorted(targets):
            there = _place(target, placement)
            if there is None:
                continue  # a namespace package's __init__
            if there[0] > where[0]:
                broken.append(f"{module} (layer {where[0]}) imports {target} (layer {there[0]}): up a layer")
            elif there[0] == where[0] and there[1] != where[1]:
                broken.append(f"{module} imports {target}: sideways within layer {where[0]}")
    assert not unplaced, f"modules no layer of docs/architecture.md names: {unplaced}"
    assert not broken, "\n".join(broken)


def _apart() -> list[tuple[str, str]]:
    """Pairs of packages within one unit that never import each other (docs/architecture.md's apart block)."""
    text = (REPO / "docs" / "architecture.md").read_text()
    block = re.search(r"<!-- apart: begin -->(.*?)<!-- apart: end -->", text, re.S)
    assert block, "docs/architecture.md has no apart block"
    return re.findall(r"^- `([\w.]+)` / `([\w.]+)`", block.group(1), re.M)


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def test_packages_held_apart_never_import_each_other() -> None:
    """The runtime's two executors (`runtime.eager`, `runtime.export`) stand on the runtime's base only."""
    modules, edges = _project_imports()
    pairs = _apart()
    assert ("slackswap.runtime.eager", "slackswap.runtime.export") in pairs
    broken = []
    for a, b in pairs:
        assert any(_under(m, a) for m in modules) and any(_under(m, b) for m in modules), (a, b)
        for source, target in ((a, b), (b, a)):
            broken += [f"{m} imports {t}" for m in sorted(modules) if _under(m, source)
                       for t in sorted(edges[m]) if _under(t, target)]
    assert not broken, "packages held apart import each other:\n" + "\n".join(broken)


def test_no_import_cycle_between_modules() -> None:
    _, edges = _project_imports()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


@pytest.mark.parametrize(
    ("source", "target", "why"),
    [
        ("slackswap.simulate.engine", "slackswap.memory.allocator_replay", "sideways"),
        ("slackswap.schedule.build", "slackswap.planners.registry", "up a layer"),
        ("slackswap.experiment.run", "pipelines.job", "up a layer"),
    ],
)
def test_the_check_catches_a_broken_import(source: str, target: str, why: str) -> None:
    """The rule itself: an import that breaks the layering is reported (not a vacuous pass)."""
    placement = _placement(_layers())
    src, dst = _place(source, placement), _place(target, placement)
    assert src is not None and dst is not None
    assert (dst[0] > src[0]) if why == "up a layer" else (dst[0] == src[0] and dst[1] != src[1])


# The library's parts behind the `torch` extra (pyproject.toml): everything else imports without torch.
TORCH_PACKAGES = ("slackswap.runtime", "slackswap.profile.torch", "slackswap.integrations")

# Prints the sorted names of slackswap's modules, found on disk (walk_packages would import the torch
# packages' __init__ to look inside them), leaving out TORCH_PACKAGES when argv[1] is "core".
_LIST_MODULES = (
    "import pathlib, sys, slackswap\n"
    "root = pathlib.Path(slackswap.__file__).parent\n"
    "names = []\n"
    "for path in sorted(root.rglob('*.py')):\n"
    "    parts = ('slackswap',) + path.relative_to(root).with_suffix('').parts\n"
    "    names.append('.'.join(parts[:-1] if parts[-1] == '__init__' else parts))\n"
    "skip = TORCH_PACKAGES if sys.argv[1] == 'core' else ()\n"
    "names = [n for n in names if not any(n == p or n.startswith(p + '.') for p in skip)]\n"
)


def _probe(body: str, scope: str, *, block_torch: bool = False) -> str:
    import subprocess
    import sys

    from pipelines.schemas import REPO_ROOT

    head = "import sys\n"
    if block_torch:  # an import of torch or transformers raises ImportError, as where they are not installed
        head += "sys.modules['torch'] = None\nsys.modules['transformers'] = None\n"
    script = head + f"TORCH_PACKAGES = {TORCH_PACKAGES!r}\n" + _LIST_MODULES + body
    out = subprocess.run([sys.executable, "-c", script, scope], cwd=REPO_ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.mark.slow
def test_library_imports_neither_hydra_nor_mlflow() -> None:
    """Every slackswap module, imported in a fresh interpreter, leaves hydra and mlflow unloaded. The
    modules behind the torch extra are part of it where torch is installed (always in CI)."""
    import importlib.util

    scope = "all" if importlib.util.find_spec("torch") is not None else "core"
    body = (
        "import importlib\n"
        "for name in names:\n"
        "    importlib.import_module(name)\n"
        "print(sorted(n for n in sys.modules if n.split('.')[0] in ('hydra', 'omegaconf', 'mlflow')))\n"
    )
    assert _probe(body, scope) == "[]"


def test_the_core_imports_without_torch() -> None:
    """Every slackswap module outside the torch packages imports with torch and transformers absent, and
    the torch packages are exactly the modules that need them (so TORCH_PACKAGES cannot go stale)."""
    # One interpreter: the core modules first, each imported as a fresh interpreter would (any error
    # fails the probe), then the torch packages' modules, whose ImportErrors are collected.
    body = (
        "import importlib\n"
        "torch_part = lambda n: any(n == p or n.startswith(p + '.') for p in TORCH_PACKAGES)\n"
        "core = [n for n in names if not torch_part(n)]\n"
        "for name in core:\n"
        "    importlib.import_module(name)\n"
        "failed = []\n"
        "for name in names:\n"
        "    if torch_part(name):\n"
        "        try:\n"
        "            importlib.import_module(name)\n"
        "        except ImportError:\n"
        "            failed.append(name)\n"
        "print(len(core))\n"
        "print(sorted({p for p in TORCH_PACKAGES if any(n == p or n.startswith(p + '.') for n in failed)}))\n"
    )
    imported, packages = _probe(body, "all", block_torch=True).splitlines()
    assert int(imported) > 40
    assert packages == str(sorted(TORCH_PACKAGES))
