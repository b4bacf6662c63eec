"""The shape of the two packages, read from their source with `ast` (nothing imported): no Python file over 700
lines, no import cycle between modules, and environment variables read only where a command line or a
configuration is resolved (never to change numerics or which kernel runs)."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO

PACKAGES = ("engine", "evalharness")
MAX_LINES = 700

# file -> the environment variables it may read, and why it is an entry point
ENVIRON_READS = {
    "engine/kernels/__init__.py": {"TRITON_INTERPRET"},  # Triton's own interpreter switch (which device may run)
    "engine/loading.py": {"HF_HUB_OFFLINE"},  # huggingface_hub's offline switch, honoured when resolving a hub id
    "evalharness/suite.py": {"DATA_DIR_ENV"},  # --data-dir / $EVALHARNESS_DATA_DIR, resolved with the suite
    "evalharness/evals/tasks.py": {"HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "EVALHARNESS_DATA_DIR"},  # lm-eval
    "evalharness/tracking.py": {"MLFLOW_TRACKING_URI", "k"},  # --tracking-uri / mlflow's own variables
    "evalharness/distributed.py": {"WORLD_SIZE", "LOCAL_RANK"},  # torchrun's rank variables
}


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the packages."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((REPO / pkg).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _runtime_imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules `name` imports, at module level or inside functions (imports under
    `if TYPE_CHECKING:` are annotations only and left out). `from pkg import sub` depends on pkg.sub only."""
    tree = ast.parse(path.read_text(), str(path))
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and "TYPE_CHECKING" in ast.unparse(node.test) for sub in node.body for n in ast.walk(sub)}
    deps: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            deps.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                base = ".".join(here[:len(here) - node.level + 1] + ([base] if base else []))
            subs = {f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules}
            deps |= subs
            if base in modules and len(subs) < len(node.names):
                deps.add(base)
    deps.discard(name)
    return deps


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_cycle_finder_finds_a_planted_cycle():
    """The checker itself: a 3-module ring and a self-contained pair are found, a chain is not."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"e"}, "e": {"d"}, "f": {"a"}, "g": set()}
    assert sorted(_cycles(graph)) == [["a", "b", "c"], ["d", "e"]]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_no_import_cycle():
    """No module of engine/ or evalharness/ imports (even lazily, inside a function) a module that imports it
    back: each cycle printed is a pair of files to untangle by moving what both need into a third."""
    modules = _modules()
    graph = {name: _runtime_imports(name, path, modules) for name, path in modules.items()}
    assert "engine.kernels.paged_cache" in graph["engine.kernels.paged_kv"]  # the parser sees imports
    assert _cycles(graph) == []


def test_no_file_over_700_lines():
    """Files with one job: none over 700 lines."""
    sizes = {str(p.relative_to(REPO)): len(p.read_text().splitlines()) for p in _modules().values()}
    assert len(sizes) > 50
    assert {f: n for f, n in sizes.items() if n > MAX_LINES} == {}


def _environ_reads(path: Path) -> set[str]:
    """Names of the variables a file reads from or writes to os.environ / os.getenv (the subscript or first
    argument as source text when it is not a string constant)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        target = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            owner = ast.unparse(node.func.value)
            if owner == "os.environ" or ast.unparse(node.func) == "os.getenv":
                target = node.args[0]
        elif isinstance(node, ast.Subscript) and ast.unparse(node.value) == "os.environ":
            target = node.slice
        if target is not None:
            names.add(target.value if isinstance(target, ast.Constant) else ast.unparse(target))
    return names


def test_environment_read_only_at_entry_points():
    """os.environ is read only by the entry points in ENVIRON_READS, for the variables listed there; no
    ENGINE_* variable anywhere (kernel choices are backend / serving options, recorded in a result)."""
    reads = {str(p.relative_to(REPO)): _environ_reads(p) for p in _modules().values()}
    reads = {f: names for f, names in reads.items() if names}
    assert "evalharness/distributed.py" in reads  # the scanner sees reads
    extra = {f: sorted(names - ENVIRON_READS.get(f, set())) for f, names in reads.items()
             if names - ENVIRON_READS.get(f, set())}
    assert extra == {}, "environment read outside an entry point: make it an option of the backend or config"
    assert not [n for names in reads.values() for n in names if n.startswith("ENGINE_")]
