"""No import circles among patchdsl's modules (read statically with ast, so nothing is imported).

Every import counts: top-level and inside functions, ``from . import x``, ``from .x import y`` and
``importlib.import_module("patchdsl.x")`` with a literal name.  The implicit import of a package's
``__init__`` by its submodules is not an edge (Python does it for every submodule); an explicit
``from ..pkg import name`` that reads the package's ``__init__`` is.  The op modules named in
``ops.registry.OP_MODULES`` are loaded by the registry by name (plugins); they import the registry,
the registry names none of them.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def module_files(pkg_dir: Path) -> dict[str, Path]:
    mods = {}
    for p in sorted(pkg_dir.rglob("*.py")):
        parts = list(p.relative_to(pkg_dir.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = p
    return mods


def import_graph(pkg_dir: Path) -> dict[str, set[str]]:
    """module -> the package's modules it imports."""
    mods = module_files(pkg_dir)
    top = pkg_dir.name

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = {m: set() for m in mods}
    for m, p in mods.items():
        pkg = m if p.name == "__init__.py" else m.rpartition(".")[0]
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"), str(p))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                    b = ".".join(base + ([node.module] if node.module else []))
                else:
                    b = node.module or ""
                names = [f"{b}.{a.name}" if f"{b}.{a.name}" in mods else b for a in node.names]
            elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
                  and isinstance(node.args[0].value, str)
                  and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"):
                names = [node.args[0].value]
            for n in names:
                if n == top or n.startswith(top + "."):
                    r = resolve(n)
                    if r and r != m:
                        edges[m].add(r)
    return edges


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def test_patchdsl_has_no_import_circle():
    found = circles(import_graph(ROOT / "patchdsl"))
    assert not found, "import circles (break each with a leaf module both sides import):\n" + \
        "\n".join(" <-> ".join(c) for c in found)


# the detector itself: each of these small packages has a circle it must find, or none
CASES = {
    "top-level from-import": ({"a.py": "from .b import x\n", "b.py": "from .a import y\n"}, [["p.a", "p.b"]]),
    "inside a function": ({"a.py": "def f():\n    from .b import x\n", "b.py": "from . import a\n"}, [["p.a", "p.b"]]),
    "import_module literal": ({"a.py": "import importlib\nimportlib.import_module('p.b')\n",
                               "b.py": "from .a import y\n"}, [["p.a", "p.b"]]),
    "three modules": ({"a.py": "import p.b\n", "b.py": "from p.c import z\n", "c.py": "from .a import q\n"},
                      [["p.a", "p.b", "p.c"]]),
    "through a subpackage": ({"a.py": "from .sub.m import x\n", "sub/__init__.py": "", "sub/m.py": "from ..a import y\n"},
                             [["p.a", "p.sub.m"]]),
    "one way only": ({"a.py": "from .b import x\n", "b.py": "import os\n"}, []),
    "a name from the package __init__": ({"__init__.py": "from .a import f\n", "a.py": "def f():\n    pass\n",
                                          "b.py": "from . import a\n"}, []),
}


@pytest.mark.parametrize("name", list(CASES))
def test_detector_finds_each_kind_of_circle(name, tmp_path):
    files, expected = CASES[name]
    pkg = tmp_path / "p"
    for rel, text in {"__init__.py": "", **files}.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    assert circles(import_graph(pkg)) == expected


# The layers of docs/architecture.md ("Imports go one way"): what each part of patchdsl may import.
# The leaf utilities (util: vocabulary, files, resources; _version) may be imported by any part.
UTILITIES = {"util", "_version"}
LAYERS = {
    "cli": {"training", "interop", "parity", "runtime", "planning", "codegen", "model", "syntax", "ops"},
    "training": {"interop", "parity", "runtime", "planning", "model", "ops", "syntax"},
    "interop": {"model", "ops", "syntax"},
    "parity": {"runtime", "planning", "codegen", "model", "ops", "distributed"},
    "runtime": {"planning", "codegen", "kernel_support", "model", "ops", "distributed"},
    "planning": {"codegen", "model", "ops", "syntax"},
    "codegen": {"kernel_support", "model", "ops"},
    "kernel_support": set(),
    "ops": {"model", "syntax", "distributed"},
    "distributed": {"model"},
    "model": set(),
    "syntax": set(),
}


def part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_imports_follow_the_layers_of_architecture_md():
    edges = import_graph(ROOT / "patchdsl")
    bad = []
    for m, targets in edges.items():
        a = part(m)
        if a in ("__init__",) or a in UTILITIES:
            continue
        assert a in LAYERS, f"{a} is a new part of patchdsl: give it a line in LAYERS and in docs/architecture.md"
        for t in targets:
            b = part(t)
            if b != a and b not in UTILITIES and b not in LAYERS[a]:
                bad.append(f"{m} imports {t}")
    assert not bad, "imports against the layers of docs/architecture.md:\n" + "\n".join(bad)
    parts = {part(m) for m in edges}
    assert set(LAYERS) <= parts, f"LAYERS names parts patchdsl no longer has: {sorted(set(LAYERS) - parts)}"
    text = (ROOT / "docs" / "architecture.md").read_text()
    assert "tests/test_import_graph.py" in text
