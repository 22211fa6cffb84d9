"""The module import graph of `jmixedkv/`, `pallas_kernels/`, `interop/` and `jmixedkv_demo/` is a DAG with one-way
layers (docs/DESIGN.md §7), checked statically from the source (AST), so it holds for code paths no test runs.

* Every ``import`` / ``from ... import`` counts, at module level **and inside functions** (a lazy import is still a
  dependency), resolved to the module it names (``from pkg import mod`` is an edge to ``pkg.mod``; a package's
  ``__init__`` is the node ``pkg``). Implicit "importing ``pkg.mod`` runs ``pkg/__init__``" edges are not part of
  this graph (see `test_importing_a_kernel_loads_only_leaf_modules` for that).
* No cycles (break one, never allow-list it).
* Kernel modules (`pallas_kernels/`) import only `LEAF_MODULES` from the library and each other, never `interop`;
  the leaf modules import only each other.
* No module in `pallas_kernels/`, `interop/`, `jmixedkv_demo/` or `bench/` imports a private (``_name``) from
  `jmixedkv`.
* The library (`jmixedkv/`, `pallas_kernels/`) imports nothing of `interop`, `jmixedkv_demo` or `bench`, and of
  third-party packages only its dependencies (jax, jaxlib, numpy, ml_dtypes): no flax, tqdm, gguf or torch.
"""
from __future__ import annotations

import ast
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("jmixedkv", "pallas_kernels", "interop", "jmixedkv_demo")
#: the library's packages and the third-party packages it may import (pyproject.toml's dependencies)
LIBRARY = ("jmixedkv", "pallas_kernels")
LIBRARY_DEPENDENCIES = {"jax", "jaxlib", "numpy", "ml_dtypes"}

#: library modules a kernel may import: they import nothing else from the packages
LEAF_MODULES = {"jmixedkv.compat", "jmixedkv.layout", "jmixedkv.numerics"}


def _modules():
    """{module name: path} of every .py file in the packages."""
    out = {}
    for pkg in PACKAGES:
        for dirpath, _, files in os.walk(os.path.join(ROOT, pkg)):
            for f in files:
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(dirpath, f), ROOT)[:-3].replace(os.sep, ".")
                    out[rel[:-len(".__init__")] if rel.endswith(".__init__") else rel] = os.path.join(dirpath, f)
    return out


def _imports(name: str, path: str, known):
    """[(target module, imported names, lineno)] for every import in the file (function bodies included)."""
    is_pkg = path.endswith("__init__.py")
    tree = ast.parse(open(path).read(), path)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                out.append((a.name, (), node.lineno))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module
            for a in node.names:
                sub = f"{mod}.{a.name}"
                if sub in known:               # ``from pkg import mod``: an edge to the module itself
                    out.append((sub, (), node.lineno))
                else:
                    out.append((mod, (a.name,), node.lineno))
    return out


def _graph():
    mods = _modules()
    edges = {m: set() for m in mods}
    detail = []
    for m, path in mods.items():
        for target, names, line in _imports(m, path, mods):
            t = target
            while t and t not in mods:          # ``import jmixedkv.x.y`` with y a name: walk up to a module
                t = t.rpartition(".")[0]
            if t and t.split(".")[0] in PACKAGES:
                if t != m:
                    edges[m].add(t)
                detail.append((m, t, names, line))
    return mods, edges, detail


def _cycles(edges):
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(frozenset(comp))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_graph_sees_the_packages():
    mods, edges, _ = _graph()
    assert {"jmixedkv", "jmixedkv.state", "jmixedkv.numerics", "pallas_kernels.write", "interop.dlpack"} <= set(mods)
    assert "jmixedkv.numerics" in edges["jmixedkv.nvfp4"]
    # lazy (in-function) imports are edges too: each op module dispatches to its kernel inside its functions
    for op, kernel in (("nvfp4", "nvfp4"), ("write", "write"), ("staging", "stage"), ("gather", "gather"),
                       ("decode", "decode")):
        assert f"pallas_kernels.{kernel}" in edges[f"jmixedkv.{op}"]


def test_no_import_cycles():
    # the detector itself: one three-module cycle, plus a module that only points into it
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [frozenset({"a", "b", "c"})]
    _, edges, _ = _graph()
    found = _cycles(edges)
    assert not found, ("import cycles (lazy imports count): "
                       + "; ".join(" <-> ".join(sorted(c)) for c in found))


def test_kernels_import_only_leaf_modules():
    _, edges, _ = _graph()
    bad = [f"{m} -> {t}" for m, targets in edges.items() if m.startswith("pallas_kernels") for t in targets
           if not (t.startswith("pallas_kernels") or t in LEAF_MODULES)]
    assert not bad, f"kernel modules may import only {sorted(LEAF_MODULES)} from the library: {bad}"


def test_leaf_modules_are_leaves():
    _, edges, _ = _graph()
    for m in LEAF_MODULES:
        assert edges[m] <= LEAF_MODULES, f"{m} is a leaf module but imports {sorted(edges[m] - LEAF_MODULES)}"


def _private_uses(name: str, path: str, mods):
    """``[(line, text)]``: private names of another package this file imports (``from jmixedkv.x import _y``) or
    reaches through an imported module (``import jmixedkv.x as m`` ... ``m._y``)."""
    own = name.split(".")[0]
    out, aliases = [], {}
    for t, names, line in _imports(name, path, mods):
        if t.split(".")[0] in PACKAGES and t.split(".")[0] != own:
            out += [(line, f"{n} from {t}") for n in names if n.startswith("_")]
    tree = ast.parse(open(path).read(), path)
    for node in ast.walk(tree):                     # module aliases bound by imports
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                if f"{node.module}.{a.name}" in mods:
                    aliases[a.asname or a.name] = f"{node.module}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.asname and a.name in mods:
                    aliases[a.asname] = a.name
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                and isinstance(node.value, ast.Name) and node.value.id in aliases
                and aliases[node.value.id].split(".")[0] != own):
            out.append((node.lineno, f"{node.attr} of {aliases[node.value.id]}"))
    return out


def test_private_use_detector(tmp_path):
    mods, _, _ = _graph()
    f = tmp_path / "probe.py"
    f.write_text("from jmixedkv.state import _append, append\nfrom jmixedkv import state as st\nst._append\n")
    assert sorted(w for _, w in _private_uses("bench.probe", str(f), mods)) == [
        "_append from jmixedkv.state", "_append of jmixedkv.state"]


def test_no_private_names_cross_a_package_boundary():
    """`pallas_kernels/`, `interop/`, `jmixedkv_demo/` and `bench/` use only public names of `jmixedkv` (and of each
    other)."""
    mods, _, _ = _graph()
    files = [(m, p) for m, p in mods.items() if m.split(".")[0] != "jmixedkv"]
    for dirpath, _, fs in os.walk(os.path.join(ROOT, "bench")):
        files += [("bench." + f[:-3], os.path.join(dirpath, f)) for f in fs if f.endswith(".py")]
    bad = [f"{os.path.relpath(p, ROOT)}:{line}: {what}" for m, p in files for line, what in _private_uses(m, p, mods)]
    assert not bad, f"private names used across a package boundary: {bad}"


def test_library_imports_only_its_dependencies():
    """`jmixedkv/` and `pallas_kernels/` never import `interop`, `jmixedkv_demo` or `bench` (lazy imports count), and
    no third-party package beyond jax, jaxlib, numpy and ml_dtypes (the demo's flax / tqdm / gguf live in
    `jmixedkv_demo`)."""
    mods = _modules()
    assert any(m.startswith("jmixedkv_demo.") for m in mods)
    bad = []
    for m, path in mods.items():
        if m.split(".")[0] not in LIBRARY:
            continue
        for target, _, line in _imports(m, path, mods):
            top = target.split(".")[0]
            if top in LIBRARY or top in LIBRARY_DEPENDENCIES or top in sys.stdlib_module_names or top == "__future__":
                continue
            bad.append(f"{os.path.relpath(path, ROOT)}:{line}: imports {target}")
    assert not bad, f"the library may import only {sorted(LIBRARY_DEPENDENCIES)} and the standard library: {bad}"


def test_library_import_guard_sees_a_forbidden_import(tmp_path):
    """The guard's own check: a lazy ``import flax`` and a ``from jmixedkv_demo import cli`` are found."""
    f = tmp_path / "probe.py"
    f.write_text("def f():\n    import flax.linen as nn\n    from jmixedkv_demo import cli\n")
    found = [t for t, _, _ in _imports("jmixedkv.probe", str(f), _modules())]
    assert "flax.linen" in found and "jmixedkv_demo.cli" in found
    assert {t.split(".")[0] for t in found} - set(LIBRARY) - LIBRARY_DEPENDENCIES == {"flax", "jmixedkv_demo"}


def test_importing_a_kernel_loads_only_leaf_modules():
    """In a fresh interpreter, importing every kernel module loads no library module beyond the leaves (and the
    package ``__init__``, whose re-exports are lazy)."""
    code = ("import sys, pallas_kernels.nvfp4, pallas_kernels.write, pallas_kernels.stage, pallas_kernels.gather, "
            "pallas_kernels.decode; print(' '.join(sorted(m for m in sys.modules "
            "if m.split('.')[0] in ('jmixedkv', 'interop'))))")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT))
    assert r.returncode == 0, r.stderr[-2000:]
    loaded = set(r.stdout.split())
    assert loaded <= LEAF_MODULES | {"jmixedkv"}, sorted(loaded - LEAF_MODULES - {"jmixedkv"})


def test_public_names_resolve_to_their_op_modules():
    """Every lazy re-export of `jmixedkv` is the object its module defines, also after every module is imported:
    no module is named like a public function (importing ``jmixedkv.x`` sets the package attribute ``x``)."""
    import importlib

    import jmixedkv as jm
    mods = {m.split(".")[1] for m in _modules() if m.startswith("jmixedkv.")}
    assert not mods & set(jm._EXPORTS), sorted(mods & set(jm._EXPORTS))
    for m in sorted(mods - {"__main__"}):
        importlib.import_module(f"jmixedkv.{m}")
    for name, m in jm._EXPORTS.items():
        assert getattr(jm, name) is getattr(importlib.import_module(f"jmixedkv.{m}"), name), name
