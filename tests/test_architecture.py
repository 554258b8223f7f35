"""posinterp's layering (issue 35): imports run downhill, no module cycle, every module in
docs/architecture.md.

Every module is parsed with ``ast`` (imports inside functions count; relative imports are
resolved), so the checks need no import of posinterp. The layers, lowest first, each may
import its own layer and those below; ``analysis`` and ``training`` are peers that may not
import each other; ``viz`` imports foundations only; the package's ``__init__.py`` may
import anything.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "posinterp"
DOC = ROOT / "docs" / "architecture.md"

# the layer map, written once: layer name -> (rank, members). A member is a module
# ("posinterp.io") or a subpackage prefix ("posinterp.models"); ranks only grow upward.
FOUNDATIONS = tuple(f"posinterp.{m}" for m in ("_disk_cache", "_lazy", "_memory", "_progress", "_rng",
                                               "_validate", "io", "specs", "devices",
                                               "executors", "stats"))
LAYERS = {
    "foundations": (0, FOUNDATIONS),
    "viz": (0, ("posinterp.viz",)),  # beside the foundations: it may import only them
    "tasks": (1, ("posinterp.tasks",)),
    "models": (2, ("posinterp.models",)),
    "analysis": (3, ("posinterp.analysis",)),
    "training": (3, ("posinterp.training",)),
    "interventions": (4, ("posinterp.interventions",)),
    "dashboard": (5, ("posinterp.dashboard",)),
    "experiments": (6, ("posinterp.experiments",)),
    "cli": (7, ("posinterp.cli",)),
    "api": (99, ("posinterp",)),  # posinterp/__init__.py re-exports everything
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def layer_of(module: str) -> str:
    """The layer of a posinterp module: the longest member prefix that contains it."""
    best, size = None, -1
    for name, (_, members) in LAYERS.items():
        for m in members:
            if (module == m or module.startswith(m + ".")) and len(m) > size:
                best, size = name, len(m)
    if best is None:
        raise AssertionError(f"{module} is in no layer of tests/test_architecture.py")
    return best


def import_graph() -> dict[str, set[str]]:
    """module -> the posinterp modules it imports (anywhere in its body)."""
    edges: dict[str, set[str]] = defaultdict(set)
    for mod, path in MODULES.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                # ``from pkg import sub`` imports the submodule pkg.sub
                targets = [f"{target}.{a.name}" if f"{target}.{a.name}" in MODULES else target
                           for a in node.names]
            for t in targets:
                while t and t not in MODULES:  # ``import posinterp.x.y`` names a module
                    t = t.rpartition(".")[0]
                if t.startswith("posinterp") and t != mod:
                    edges[mod].add(t)
    return edges


def upward_imports() -> list[str]:
    bad = []
    for a, targets in sorted(import_graph().items()):
        la = layer_of(a)
        for b in sorted(targets):
            lb = layer_of(b)
            if la == lb or la == "api":
                continue
            ra, rb = LAYERS[la][0], LAYERS[lb][0]
            if (la == "viz" and lb != "foundations") or (la != "viz" and rb >= ra):
                bad.append(f"{a} ({la}) -> {b} ({lb})")
    return bad


def import_cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    g = import_graph()
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]

    def enter(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)

    def visit(root):
        work = [(root, iter(sorted(g.get(root, ()))))]
        enter(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    enter(w)
                    work.append((w, iter(sorted(g.get(w, ())))))
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

    for v in sorted(MODULES):
        if v not in index:
            visit(v)
    return out


def test_every_module_has_a_layer():
    for m in MODULES:
        layer_of(m)


def test_the_scanner_sees_function_level_and_relative_imports():
    g = import_graph()
    # analysis/frequencies.py imports ._rotary_kernel inside a function (relative)
    assert "posinterp.analysis._rotary_kernel" in g["posinterp.analysis.frequencies"]
    assert "posinterp.stats" in g["posinterp.analysis.fingerprint"]


def test_no_import_cycle():
    cycles = import_cycles()
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_imports_run_downhill():
    bad = upward_imports()
    assert not bad, f"{len(bad)} upward imports:\n" + "\n".join(bad)


def documented(rel: str, text: str) -> bool:
    """Whether docs/architecture.md names module file ``rel`` (relative to posinterp/).

    The rule: its path appears as a code span (`` `models/toy.py` ``), or its file name does
    in a row, bullet or paragraph that also names its folder (a row like `` `analysis/similarity.py`,
    `adjacency.py` `` or `` `tasks/` | `tokenizer.py` ``). A package's ``__init__.py`` is
    named by its folder (`` `tasks/` `` or any `` `tasks/...` ``).
    """
    folder, _, name = rel.rpartition("/")
    if name == "__init__.py":
        return not folder or f"`{folder}/" in text
    if f"`{rel}`" in text:
        return True
    return bool(folder) and any(f"`{folder}/" in item and f"`{name}`" in item
                                for item in _items(text))


def _items(text: str) -> list[str]:
    """The doc's rows, bullets and paragraphs, each one string (wrapped lines joined)."""
    items: list[str] = []
    fresh = True
    for line in text.splitlines():
        s = line.strip()
        if not s:
            fresh = True
            continue
        if fresh or s.startswith(("|", "* ", "- ", "#")):
            items.append(s)
        else:
            items[-1] += " " + s
        fresh = False
    return items


def test_architecture_doc_names_every_module():
    text = DOC.read_text()
    missing = [rel for p in sorted(PKG.rglob("*.py"))
               if not documented(rel := p.relative_to(PKG).as_posix(), text)]
    assert not missing, "docs/architecture.md does not name:\n" + "\n".join(missing)


def test_the_doc_rule():
    text = "| `analysis/similarity.py`, `adjacency.py` | x |\n| `io.py` | y |\n`tasks/`"
    assert documented("analysis/adjacency.py", text) and documented("io.py", text)
    assert documented("tasks/__init__.py", text) and not documented("analysis/heads.py", text)
    assert not documented("models/adjacency.py", text)


def version_tests_outside_backend() -> list[str]:
    """Modules outside ``models/backend/`` that read the TransformerLens major version
    (``TL_MAJOR``, ``transformer_lens.__version__``): the line is chosen in the adapter
    package only (``backend.by_line``); recording the version as metadata is not a test."""
    bad = []
    for mod, path in MODULES.items():
        if mod.startswith("posinterp.models.backend"):
            continue
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            hit = ((isinstance(node, ast.Name) and node.id == "TL_MAJOR")
                   or (isinstance(node, ast.alias) and node.name == "TL_MAJOR")
                   or (isinstance(node, ast.Attribute) and node.attr == "__version__"
                       and isinstance(node.value, ast.Name) and node.value.id == "transformer_lens"))
            if hit:
                bad.append(f"{mod}:{getattr(node, 'lineno', '?')}")
    return bad


def test_no_transformerlens_version_test_outside_the_adapter():
    bad = version_tests_outside_backend()
    assert not bad, "TransformerLens version read outside models/backend/:\n" + "\n".join(bad)


@pytest.mark.parametrize("package, name, home", [
    ("posinterp.analysis", "inspect_heads", "posinterp.dashboard"),
    ("posinterp.analysis", "Inspection", "posinterp.dashboard"),
    ("posinterp.viz", "inspect_page", "posinterp.dashboard.inspect_html"),
    ("posinterp.viz", "save_compare_page", "posinterp.dashboard.compare_html"),
    ("posinterp.viz", "head_card_figure", "posinterp.dashboard.cards"),
])
def test_names_that_moved_with_the_dashboard_are_refused_with_their_new_home(package, name, home):
    import importlib

    with pytest.raises(ImportError, match=rf"from {home} import {name}"):
        exec(f"from {package} import {name}", {})
    assert hasattr(importlib.import_module(home), name)
