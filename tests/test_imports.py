"""The package's import graph: every module imports, the graph inside ``ulysses_kernels`` has
no cycle, and nothing imports the modules the communicator package replaced.

The graph is read from the source with ``ast``. An edge ``a -> b`` is an import statement in
``a`` naming ``b``: ``import ulysses_kernels.b``, ``from . import b`` (an edge to the
submodule ``b``, not to the package it is in), ``from .b import name``. A module's parent
packages are imported first by Python, but that is no edge: a package's ``__init__`` that
imports its own submodules is no cycle. Module-level imports are the import graph proper;
imports inside functions are checked too, because an import deferred to call time to get
around a cycle is still a cycle.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import pathlib

import ulysses_kernels

PACKAGE = "ulysses_kernels"
ROOT = pathlib.Path(ulysses_kernels.__file__).resolve().parent
CHECKOUT = ROOT.parent

# Modules the communicator package replaced; nothing may import them again.
REMOVED = ("ulysses_kernels.nccl_comm", "ulysses_kernels.bench.common")


def _modules() -> dict[str, pathlib.Path]:
    """Every module of the package: dotted name -> file."""
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _is_package(name: str, modules) -> bool:
    return modules[name].name == "__init__.py"


def _imports(name: str, tree: ast.Module, modules, module_level: bool) -> set[str]:
    """The package's modules that ``name`` imports: at module level (outside every function)
    when ``module_level``, else inside functions only."""
    package = name if _is_package(name, modules) else name.rpartition(".")[0]
    found = set()

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, (ast.Import, ast.ImportFrom)) and in_function != module_level:
                found.update(_targets(child, package, modules))
            visit(child, inner)

    visit(tree, False)
    return found


def _targets(node, package: str, modules) -> set[str]:
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names if alias.name in modules}
    if node.level:
        base = package.split(".")
        base = base[: len(base) - node.level + 1]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    targets = set()
    for alias in node.names:
        sub = f"{source}.{alias.name}"
        if sub in modules:
            targets.add(sub)  # a submodule: `from pkg import sub` needs only `sub`
        elif source in modules:
            targets.add(source)
    return targets


def _graph(module_level: bool) -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, ast.parse(path.read_text(), str(path)), modules, module_level) - {name} for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path ``[a, b, ..., a]``, or None."""
    state = {}  # absent: not seen; 1: on the current path; 2: done
    path = []

    def visit(node):
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_cycle_finder_finds_a_cycle():
    # The check below is only as good as this finder: a cycle must be reported, a DAG not.
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_graph_reads_relative_absolute_and_submodule_imports():
    modules = {
        "pkg": pathlib.Path("pkg/__init__.py"),
        "pkg.a": pathlib.Path("pkg/a.py"),
        "pkg.sub": pathlib.Path("pkg/sub/__init__.py"),
        "pkg.sub.b": pathlib.Path("pkg/sub/b.py"),
        "pkg.sub.c": pathlib.Path("pkg/sub/c.py"),
    }
    source = (
        "import os\n"
        "import pkg.a\n"
        "from .. import a\n"  # a submodule of the parent package: an edge to it only
        "from . import c\n"
        "from .c import name\n"
        "from ..sub import helper\n"  # a name of the package: an edge to its __init__
        "def f():\n"
        "    from .. import sub\n"
    )
    tree = ast.parse(source)
    assert _imports("pkg.sub.b", tree, modules, module_level=True) == {"pkg.a", "pkg.sub.c", "pkg.sub"}
    assert _imports("pkg.sub.b", tree, modules, module_level=False) == {"pkg.sub"}
    # In a package's __init__, `from .b import x` is relative to the package itself.
    assert _imports("pkg.sub", ast.parse("from .b import x\n"), modules, module_level=True) == {"pkg.sub.b"}
    # And the real package is read: comm/__init__.py imports its submodules.
    graph = _graph(module_level=True)
    assert {"ulysses_kernels.comm.base", "ulysses_kernels.comm.nccl"} <= graph["ulysses_kernels.comm"]
    assert "ulysses_kernels.comm.base" in graph["ulysses_kernels.comm.channel"]


def test_no_import_cycle_at_module_level():
    cycle = _cycle(_graph(module_level=True))
    assert cycle is None, f"import cycle inside {PACKAGE}: {' -> '.join(cycle)}"


def test_no_import_cycle_with_imports_inside_functions():
    module_level, in_functions = _graph(module_level=True), _graph(module_level=False)
    both = {name: module_level[name] | in_functions[name] for name in module_level}
    cycle = _cycle(both)
    assert cycle is None, f"import cycle inside {PACKAGE} through an import inside a function: {' -> '.join(cycle)}"


# The op package (``ulysses_kernels.attention``: the public face, the resolved call, the
# exchanges and the three schedules) sits on top of the layers it uses (layout, kernels, comm,
# gqa, checkpointing, backends, ring, ...): none of them imports it back. Only the package's
# face and the users of the op above it do.
ABOVE_THE_OP = (
    "ulysses_kernels",
    "ulysses_kernels.layers",  # the model side: the one attention function and the mixers run the op
    "ulysses_kernels.integrations.",
    "ulysses_kernels.bench.",
    "ulysses_kernels.selftest",
    "ulysses_kernels.demo",
)


def test_the_op_package_is_imported_only_from_above():
    module_level, in_functions = _graph(module_level=True), _graph(module_level=False)
    op = "ulysses_kernels.attention"
    assert op in module_level and f"{op}.chunked" in module_level, "the op package moved: update this test"
    below = []
    for name in sorted(module_level):
        if name == op or name.startswith(op + "."):
            continue
        hits = sorted(t for t in module_level[name] | in_functions[name] if t == op or t.startswith(op + "."))
        if hits and not (name == ABOVE_THE_OP[0] or name.startswith(ABOVE_THE_OP[1:])):
            below.append(f"{name} imports {', '.join(hits)}")
    assert not below, "modules below the op package import it:\n" + "\n".join(below)


def test_comm_base_imports_nothing_of_ours():
    assert _graph(module_level=True)["ulysses_kernels.comm.base"] == set()


def _imported_names(node) -> list[str]:
    """The dotted names an import statement names (relative ones without their dots)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        base = node.module or ""
        return [base, *(f"{base}.{alias.name}".lstrip(".") for alias in node.names)]
    return []


def _imports_another_package(node) -> bool:
    """An absolute import of a package other than ours (``import torch``, ``from torchtitan.x import y``)."""
    if isinstance(node, ast.Import):
        return all(alias.name.split(".")[0] != PACKAGE for alias in node.names)
    return isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] != PACKAGE


def test_removed_modules_are_gone_and_not_imported():
    modules = _modules()
    for name in REMOVED:
        assert name not in modules, f"{name} exists again"
        assert importlib.util.find_spec(name) is None, f"{name} is importable"
    leaves = {name.rpartition(".")[2] for name in REMOVED}
    dirs = ("ulysses_kernels", "tests", "bench", "examples", "scripts")
    files = [p for d in dirs if (CHECKOUT / d).is_dir() for p in sorted((CHECKOUT / d).rglob("*.py"))]
    assert files, f"no Python files found under {CHECKOUT}"
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if _imports_another_package(node):
                continue  # torchtitan.models.common is not our bench.common
            for name in _imported_names(node):
                hit = leaves & set(name.split("."))
                assert not hit, f"{path.relative_to(CHECKOUT)}:{node.lineno} imports {name} (removed module {hit.pop()})"


def test_every_module_imports():
    failed = []
    for name in _modules():
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - every failure is reported together below
            failed.append(f"{name}: {type(e).__name__}: {e}")
    assert not failed, "modules that do not import:\n" + "\n".join(failed)


# Modules renamed for what they hold (#40); the old paths are gone, with no shim left behind.
RENAMED = {
    "ulysses_kernels.ops": "ulysses_kernels.extension",
    "ulysses_kernels.reference": "ulysses_kernels.math_attention (and ulysses_kernels.testing.reference)",
    "ulysses_kernels.longctx.install": "ulysses_kernels.longctx.patches",
    "ulysses_kernels.integrations.alst": "ulysses_kernels.integrations.deepspeed_alst",
    # #47: the families' forwards (private names only) went to one module per family
    "ulysses_kernels.integrations.hf.mixer_forwards": "a module per family in ulysses_kernels.layers.mixers",
    "ulysses_kernels.layers.mixers.forwards": "a module per family in ulysses_kernels.layers.mixers",
}


# #47: the model side moved out of the transformers integration; the old names answer with the new modules.
MOVED = {
    "ulysses_kernels.integrations.hf.adapter": "ulysses_kernels.layers.attention",
    "ulysses_kernels.integrations.hf.masks": "ulysses_kernels.layers.masks",
    "ulysses_kernels.integrations.hf.audit": "ulysses_kernels.layers.audit",
    "ulysses_kernels.integrations.hf.mixers": "ulysses_kernels.layers.mixers",
    "ulysses_kernels.integrations.hf.mixer_exchange": "ulysses_kernels.layers.mixers.exchange",
}


def test_moved_modules_answer_under_their_old_names():
    from ulysses_kernels.integrations import hf

    for old, new in MOVED.items():
        assert importlib.import_module(old) is importlib.import_module(new), old
        assert getattr(hf, old.rsplit(".", 1)[1]) is importlib.import_module(new), old
    from ulysses_kernels.integrations.hf.mixers import HANDLED_MIXERS  # the name docs quoted as hf.mixers.HANDLED_MIXERS

    assert "BambaMixer" in HANDLED_MIXERS


def test_renamed_modules_are_gone():
    for old, new in RENAMED.items():
        assert importlib.util.find_spec(old) is None, f"{old} is importable again (it is {new} now)"


# No module of the package over this many lines (#40: the three giant modules were split by job).
MAX_MODULE_LINES = 600


def _private_uses(name: str, tree: ast.Module, modules) -> list[str]:
    """The ``_``-private names of another package of ours that module ``name`` imports
    (``from pkg.mod import _x``) or reads off a module of another package (``mod._x``)."""
    own = name if _is_package(name, modules) else name.rpartition(".")[0]

    def package_of(module: str) -> str:
        return module if _is_package(module, modules) else module.rpartition(".")[0]

    found, aliases = [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            source = next(iter(_targets(ast.ImportFrom(module=node.module, names=[ast.alias("_")], level=node.level), own, modules)), None)
            for alias in node.names:
                sub = f"{source}.{alias.name}" if source else None
                if sub in modules:  # a module imported by name: its attributes are checked below
                    aliases[alias.asname or alias.name] = sub
                elif source and alias.name.startswith("_") and not alias.name.startswith("__") and package_of(source) != own:
                    found.append(f"{name}: from {source} import {alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in modules and alias.asname:
                    aliases[alias.asname] = alias.name
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            module = aliases[node.value.id]
            if node.attr.startswith("_") and not node.attr.startswith("__") and package_of(module) != own:
                found.append(f"{name}: {node.value.id}.{node.attr} ({module})")
    return found


def test_no_private_name_is_used_across_packages():
    """What one package needs of another is public: no ``_``-private name crosses a package line."""
    modules = _modules()
    found = [use for name, path in modules.items() for use in _private_uses(name, ast.parse(path.read_text(), str(path)), modules)]
    assert not found, "\n".join(found)


def test_the_private_name_finder_finds_both_forms():
    modules = _modules()
    code = "from .hf.batch import _x\nfrom .hf import model as m\nm._y\nfrom . import verl\nverl._z\n"
    found = _private_uses("ulysses_kernels.integrations.deepspeed", ast.parse(code), modules)
    assert found == [
        "ulysses_kernels.integrations.deepspeed: from ulysses_kernels.integrations.hf.batch import _x",
        "ulysses_kernels.integrations.deepspeed: m._y (ulysses_kernels.integrations.hf.model)",
    ], found  # verl is in deepspeed's own package


def test_no_module_is_over_the_line_limit():
    long = {name: n for name, path in _modules().items() if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split them by job): {long}"
