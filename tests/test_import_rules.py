"""The package rules of docs/architecture.md, checked on the source: who may import whom, and
no import cycles.

Every ``import`` / ``from ... import`` in ``structspec/`` counts, at module level or inside a
function, under ``TYPE_CHECKING`` or not: a function-level import is still a dependency, and a
cycle through one is still a cycle to whoever reads the code.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "structspec"

#: Runtime packages (or modules) below the entry points. ``scheduler`` is the only one that
#: may know both ``grammar`` and ``speculative``.
RUNTIME = ("scheduler", "runner", "grammar", "speculative", "kvcache", "models", "layers",
           "kernels", "draft_tree", "staging")

#: (importer, imported) pairs that must never appear.
FORBIDDEN = {
    ("grammar", "speculative"), ("speculative", "grammar"),
    ("runner", "grammar"), ("runner", "speculative"), ("runner", "scheduler"),
    ("grammar", "scheduler"), ("speculative", "scheduler"),
    ("grammar", "runner"),
    ("models", "speculative"), ("models", "grammar"), ("models", "scheduler"),
    ("models", "runner"),
    ("layers", "runner"), ("layers", "scheduler"), ("layers", "grammar"),
    ("layers", "speculative"), ("layers", "models"),
    ("kernels", "runner"), ("kernels", "scheduler"), ("kernels", "grammar"),
    ("kernels", "speculative"), ("kernels", "models"),
    ("kvcache", "runner"), ("kvcache", "scheduler"), ("kvcache", "grammar"),
    ("kvcache", "speculative"), ("kvcache", "models"),
    ("draft_tree", "runner"), ("draft_tree", "scheduler"), ("draft_tree", "grammar"),
    ("draft_tree", "speculative"), ("draft_tree", "models"),
    ("staging", "runner"), ("staging", "scheduler"), ("staging", "grammar"),
    ("staging", "speculative"), ("staging", "models"), ("staging", "draft_tree"),
}

#: Entry points and wiring may import what they assemble, but no runtime package imports them.
ENTRY = ("cli", "llm", "server", "engine", "engine_args", "__main__", "training")


def module_name(path: Path) -> str:
    """``structspec/a/b.py`` -> ``structspec.a.b`` (a package's ``__init__`` is the package)."""
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path) -> set[str]:
    """The ``structspec`` modules that ``path`` imports anywhere in its body."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    here = module_name(path).split(".")
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("structspec"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = here if is_package else here[:-1]
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if not mod.startswith("structspec"):
                continue
            out.add(mod)
            # ``from structspec.pkg import sub``: the submodule when it exists
            for a in node.names:
                sub = f"{mod}.{a.name}"
                if _exists(sub):
                    out.add(sub)
    return out


def _exists(module: str) -> bool:
    rel = Path(*module.split(".")[1:])
    return (ROOT / rel).with_suffix(".py").is_file() or (ROOT / rel / "__init__.py").is_file()


def import_graph() -> dict[str, set[str]]:
    """Module -> the ``structspec`` modules it imports (existing modules only)."""
    graph: dict[str, set[str]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        graph[module_name(path)] = {m for m in imports_of(path) if _exists(m)}
    return graph


def area(module: str) -> str:
    """The top-level package or module of ``structspec.X...`` (``""`` for ``structspec``)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_graph_sees_every_module_and_some_edges() -> None:
    graph = import_graph()
    assert "structspec.scheduler.scheduler" in graph
    assert sum(len(v) for v in graph.values()) > 100  # the walk found the imports


def test_no_forbidden_package_edges() -> None:
    bad = sorted(
        f"{src} -> {dst}" for src, dsts in import_graph().items() for dst in dsts
        if (area(src), area(dst)) in FORBIDDEN
        or (area(src) in RUNTIME and area(dst) in ENTRY)
    )
    assert not bad, "forbidden imports (docs/architecture.md, package rules):\n" + "\n".join(bad)


def test_only_scheduler_and_wiring_know_grammar_and_speculative() -> None:
    graph = import_graph()
    both: dict[str, set[str]] = {}
    for src, dsts in graph.items():
        both.setdefault(area(src), set()).update(area(d) for d in dsts)
    knows_both = sorted(a for a, dsts in both.items()
                        if {"grammar", "speculative"} <= dsts and a in RUNTIME)
    assert knows_both == ["scheduler"]


def test_no_import_cycles() -> None:
    graph = import_graph()
    # Tarjan's strongly connected components (iterative: the graph is small, but be safe).
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    cycles: list[list[str]] = []
    counter = 0
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    comp.append(m)
                    if m == node:
                        break
                # a package importing its own submodule through __init__ is not a cycle of
                # two modules the reader follows; every other component of 2+ is
                if len(comp) > 1:
                    cycles.append(sorted(comp))
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


@pytest.mark.parametrize("pattern", ["../shared", "DESIGN.md"])
def test_source_points_at_nothing_outside_the_repository(pattern: str) -> None:
    offenders = [str(p.relative_to(ROOT.parent)) for p in ROOT.rglob("*.py")
                 if pattern in p.read_text()]
    assert not offenders, f"{pattern!r} cited in: {offenders}"
