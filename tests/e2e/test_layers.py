"""The layer contract: every kvcore module imports only from packages ranked below its own.

Every import counts (module level, inside functions, under ``TYPE_CHECKING``), so a lazy import cannot
hide an upward edge or a cycle. The order is tests/layer_order.py's, which ``docs/design.md``'s table is
generated from.
"""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
import warnings
from pathlib import Path

import layer_order
import pytest

ROOT = Path(__file__).resolve().parents[2]
# The installed name of each source folder (pyproject.toml's package-dir).
SOURCES = {"kvcore": ROOT / "kvcore", "kvcore.backends": ROOT / "backends", "kvcore.conformance": ROOT / "conformance"}

# Lowest first (tests/layer_order.py, which docs/design.md's table is generated from).
LAYERS: list[tuple[str, ...]] = [packages for packages, _ in layer_order.LAYERS]
#: modules that moved, and where to: each old path is a shim that imports its new home and warns. They rank
#: above everything, so nothing in kvcore imports them, and the package each stands in keeps its place.
MOVED = {
    "kvcore.backends.ngram": "kvcore.speculative.ngram",
    "kvcore.backends.draft": "kvcore.speculative.draft",
    "kvcore.backends.backoff": "kvcore.speculative.backoff",
    "kvcore.sampling.speculative": "kvcore.sampling.rejection",
}
LAYERS.append(tuple(MOVED))
# The public entry points that may stand at kvcore/'s top level.
TOP_LEVEL = {"__init__", "errors", "hookspecs", "paths", "version"}
MAX_LINES = 300


def rank_of(module: str) -> int | None:
    """The rank of ``module``'s package, or None for the ``kvcore`` facade itself."""
    best = None
    for rank, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                best = rank
    return best


def module_name(package: str, folder: Path, path: Path) -> str:
    parts = list(path.relative_to(folder).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([package, *parts])


def imports_of(source: str, module: str, is_package: bool, known: set[str]) -> set[str]:
    """Every kvcore module ``source`` imports, wherever the import statement stands."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            # `from package import submodule` imports the submodule (the package's __init__ already runs)
            subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in known]
            targets = subs if len(subs) == len(node.names) else [target, *subs]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import a.b.c` names a module; an attribute path does not
                target = target.rpartition(".")[0]
            if target and target.startswith("kvcore") and target != module:
                found.add(target)
    return found


def import_graph(sources: dict[str, Path] = SOURCES) -> dict[str, set[str]]:
    files = {}
    for package, folder in sources.items():
        for path in sorted(folder.rglob("*.py")):
            if "build" in path.relative_to(folder).parts:
                continue
            files[module_name(package, folder, path)] = path
    known = set(files)
    return {m: imports_of(p.read_text(), m, p.name == "__init__.py", known) for m, p in files.items()}


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    out = []
    for module, targets in sorted(graph.items()):
        mine = rank_of(module)
        if mine is None:
            continue  # the facade re-exports the public names of every layer
        for target in sorted(targets):
            theirs = rank_of(target)
            if theirs is None or theirs > mine or (theirs == mine and _package(target) != _package(module)):
                out.append(f"{module} imports {target}")
    return out


def _package(module: str) -> str:
    for prefixes in LAYERS:
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                return prefix
    return module


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
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
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


@pytest.fixture(scope="module")
def graph():
    return import_graph()


def test_every_module_has_a_layer(graph):
    unranked = [m for m in graph if m != "kvcore" and rank_of(m) is None]
    assert not unranked, f"modules outside every layer: {unranked}"


def test_imports_point_down(graph):
    assert layer_violations(graph) == []


def test_no_import_cycles(graph):
    assert cycles(graph) == []


def test_backends_hold_attention_only(graph):
    """Attention backends and KV caches build on the contracts and kernels, not on the runtime above them."""
    runtime = ("kvcore.execution", "kvcore.scheduling", "kvcore.model", "kvcore.speculative", "kvcore.engine")
    backends = [m for m in graph if m.startswith("kvcore.backends") and m not in MOVED]
    assert "kvcore.backends.sdpa" in backends
    assert [f"{m} imports {t}" for m in backends for t in graph[m] if t.startswith(runtime)] == []


def test_moved_modules_are_shims(graph):
    """Each old path imports only its new home."""
    assert {old: graph[old] for old in MOVED} == {old: {new} for old, new in MOVED.items()}


def test_moved_modules_warn_once_and_are_the_new_ones():
    for old, new in MOVED.items():
        sys.modules.pop(old, None)
        with pytest.warns(DeprecationWarning, match=f"^{old} moved to {new}; import it from there$"):
            module = importlib.import_module(old)
        assert module is importlib.import_module(new)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert importlib.import_module(old) is module  # warned once: now the new module itself


def test_a_moved_module_warns_a_script_that_imports_it():
    """Python shows a DeprecationWarning only when it names the user's own code (``__main__``), not the shim."""
    old = "kvcore.backends.backoff"  # imports no torch
    run = subprocess.run([sys.executable, "-c", f"import {old}"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stderr.startswith(f"<string>:1: DeprecationWarning: {old} moved to "), run.stderr


def test_top_level_holds_only_entry_points():
    names = {p.stem for p in SOURCES["kvcore"].glob("*.py")}
    assert names == TOP_LEVEL


def test_package_docstrings_leave_the_order_to_the_table():
    """The ranks are written once (tests/layer_order.py, docs/design.md's generated table): a package docstring
    that numbers its layer goes stale when the order changes."""
    numbered = [str(p.relative_to(ROOT)) for folder in SOURCES.values() for p in folder.rglob("__init__.py")
                if re.search(r"\(layer \d", ast.get_docstring(ast.parse(p.read_text())) or "")]
    assert numbered == []


def test_modules_stay_small():
    long = {}
    for folder in SOURCES.values():
        for path in folder.rglob("*.py"):
            lines = len(path.read_text().splitlines())
            if lines > MAX_LINES:
                long[str(path.relative_to(ROOT))] = lines
    assert long == {}


def test_an_upward_import_is_caught(tmp_path):
    """The contract fails when a lower layer imports a higher one, even lazily, and sees the cycle."""
    (tmp_path / "interfaces").mkdir()
    (tmp_path / "engine").mkdir()
    (tmp_path / "__init__.py").write_text("")
    (tmp_path / "interfaces" / "__init__.py").write_text("")
    (tmp_path / "engine" / "__init__.py").write_text("")
    (tmp_path / "interfaces" / "attention.py").write_text("def f():\n    from kvcore.engine.core import Engine\n")
    (tmp_path / "engine" / "core.py").write_text("from kvcore.interfaces.attention import f\n")
    planted = import_graph({"kvcore": tmp_path})
    assert layer_violations(planted) == ["kvcore.interfaces.attention imports kvcore.engine.core"]
    assert cycles(planted) == [["kvcore.engine.core", "kvcore.interfaces.attention"]]


def test_a_sideways_import_is_caught(tmp_path):
    (tmp_path / "scheduling").mkdir()
    (tmp_path / "model").mkdir()
    (tmp_path / "scheduling" / "request.py").write_text("")
    (tmp_path / "model" / "decoder.py").write_text("")
    (tmp_path / "scheduling" / "scheduler.py").write_text("from kvcore.model import decoder\n")
    planted = import_graph({"kvcore": tmp_path})
    assert layer_violations(planted) == ["kvcore.scheduling.scheduler imports kvcore.model.decoder"]


# -- benchmarks/: the kvcore-bench package and the scripts beside it ------------------------------------
BENCH = ROOT / "benchmarks"
BENCH_PACKAGE = {"kvcore_bench": BENCH / "kvcore_bench"}
SCRIPT_FOLDERS = ("micro", "ab", "studies")  # run as `python benchmarks/<folder>/<script>.py`


def script_graph(bench: Path = BENCH) -> dict[str, set[str]]:
    """``folder.script`` -> the scripts it imports by bare name (python puts the script's own folder first
    on sys.path, so only a sibling resolves) and the kvcore_bench modules it imports."""
    package = set(import_graph({"kvcore_bench": bench / "kvcore_bench"}))
    paths = [p for folder in SCRIPT_FOLDERS for p in sorted((bench / folder).glob("*.py"))]
    scripts = {f"{p.parent.name}.{p.stem}": p for p in paths}
    graph = {}
    for name, path in scripts.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                targets = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            for target in targets:
                head = target.partition(".")[0]
                if target in package:
                    found.add(target)
                elif head in {s.partition(".")[2] for s in scripts}:
                    found.add(f"{path.parent.name}.{head}")
        graph[name] = found
    return graph


def test_benchmarks_have_no_import_cycle():
    package = import_graph(BENCH_PACKAGE)
    assert set(package) >= {"kvcore_bench.bench", "kvcore_bench.common", "kvcore_bench.cli"}
    assert cycles({**package, **script_graph()}) == []


def test_benchmark_scripts_import_only_their_own_folder():
    graph = script_graph()
    missing = sorted(f"{script} imports {target} (no such script in its folder)" for script, targets in graph.items()
                     for target in targets if not target.startswith("kvcore_bench") and target not in graph)
    assert graph and missing == []


def test_kvcore_bench_modules_stay_small():
    long = {str(p.relative_to(ROOT)): n for p in sorted(BENCH_PACKAGE["kvcore_bench"].glob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_a_benchmark_cycle_is_caught(tmp_path):
    (tmp_path / "kvcore_bench").mkdir()
    (tmp_path / "micro").mkdir()
    (tmp_path / "kvcore_bench" / "bench.py").write_text("def f():\n    from kvcore_bench.scale import g\n")
    (tmp_path / "kvcore_bench" / "scale.py").write_text("from kvcore_bench.bench import f\n")
    (tmp_path / "micro" / "a.py").write_text("from b import x\n")
    (tmp_path / "micro" / "b.py").write_text("import a\nfrom kvcore_bench.bench import f\n")
    planted = {**import_graph({"kvcore_bench": tmp_path / "kvcore_bench"}), **script_graph(tmp_path)}
    assert planted["micro.b"] == {"micro.a", "kvcore_bench.bench"}
    assert cycles(planted) == [["kvcore_bench.bench", "kvcore_bench.scale"], ["micro.a", "micro.b"]]
