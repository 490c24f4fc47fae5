#!/usr/bin/env python3
"""Print the import cycles between unbroken's modules, the arrows that run up the layers,
and the modules over the line limit. Exit 1 if there is any of them.

    python scripts/import_graph.py [--root unbroken] [--max-lines 600] [--edges]

Stdlib ``ast`` only: every ``import``/``from ... import`` in a module counts, at the top, in
functions and under ``TYPE_CHECKING`` alike (a circle through type hints is still a circle
of knowledge). ``from pkg import name`` is an arrow to ``pkg.name`` when that is a module,
else to ``pkg``. The layer rules are :data:`FORBIDDEN` and :data:`LAYERS`.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

#: (importer prefix, imported prefix, why): no module under the first may import the second.
FORBIDDEN: tuple[tuple[str, str, str], ...] = (
    ("unbroken.names", "unbroken.", "the vocabulary is the ground floor"),
    ("unbroken.units", "unbroken.", "size arithmetic is the ground floor"),
    ("unbroken.errors", "unbroken.", "the exceptions are the ground floor"),
    ("unbroken.comm", "unbroken.checkpoint", "collective machinery lies below the checkpoint engine (state: unbroken.state)"),
    ("unbroken.comm", "unbroken.optim", "collective machinery lies below the optimizer"),
    ("unbroken.comm", "unbroken.recovery", "collective machinery lies below recovery"),
    ("unbroken.comm", "unbroken.worker", "collective machinery lies below the worker"),
    ("unbroken.recovery", "unbroken.optim", "recovery policy must not know the optimizer"),
    ("unbroken.recovery", "unbroken.worker", "recovery policy is pure"),
    ("unbroken.recovery", "unbroken.controller", "recovery policy is pure"),
    ("unbroken.checkpoint", "unbroken.optim", "the checkpoint engine must not know the optimizer"),
    ("unbroken.checkpoint", "unbroken.worker", "the checkpoint engine lies below the worker"),
    ("unbroken.controller", "unbroken.optim", "the controller must not know the optimizer"),
    ("unbroken.controller", "unbroken.worker", "the controller and the worker meet only on the wire"),
    ("unbroken.controller", "unbroken.agent", "the agent hosts the controller, not the reverse"),
    ("unbroken.controller", "unbroken.ops", "the launcher hands the live view to the controller"),
    ("unbroken.ops", "unbroken.controller", "the live view reads what it is given, not the controller"),
    ("unbroken.worker_config", "unbroken.config", "the launcher's config builds on what a worker is told"),
    ("unbroken.worker", "unbroken.config", "a worker reads its environment (worker_config), not the launcher's flags"),
    ("unbroken.worker", "unbroken.controller", "the controller and the worker meet only on the wire"),
    ("unbroken.worker", "unbroken.agent", "the worker and the agent meet only on the wire"),
    ("unbroken.worker", "unbroken.optim", "the worker talks to recoverable state through worker.api"),
    ("unbroken.consensus", "unbroken.controller", "the durable store lies below the controller it serves"),
    ("unbroken.consensus", "unbroken.agent", "the durable store lies below the agent that hosts a seat"),
    ("unbroken.protocol", "unbroken.controller", "the protocol lies below both ends"),
    ("unbroken.protocol", "unbroken.worker", "the protocol lies below both ends"),
    ("unbroken.protocol", "unbroken.agent", "the protocol lies below both ends"),
)


#: The layers, lowest first, above the ground floor (names, units, errors: they import nothing):
#: (package, the only packages it may import besides its own, why). An arrow to anything else
#: is forbidden like a :data:`FORBIDDEN` one.
LAYERS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("unbroken.state", ("unbroken.errors", "unbroken.names", "unbroken.units"),
     "a rank's state (dtypes, tree, blob) lies below every package that moves or stores it"),
)


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, name: str, modules: set[str]) -> set[str]:
    """The modules of ``modules`` that the module ``name`` (file ``path``) imports."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.add(sub if sub in modules else base)
    return {m for m in out if m in modules and m != name}


def build_graph(root: Path) -> dict[str, set[str]]:
    files = {module_name(root, p): p for p in sorted(root.rglob("*.py"))}
    modules = set(files)
    return {name: imports_of(path, name, modules) for name, path in files.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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

    sys.setrecursionlimit(max(1000, 4 * len(graph)))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def _under(name: str, prefix: str) -> bool:
    return name == prefix.rstrip(".") or name.startswith(prefix if prefix.endswith(".") else prefix + ".")


def forbidden_arrows(graph: dict[str, set[str]]) -> list[tuple[str, str, str]]:
    """(importer, imported, rule) for every arrow a :data:`FORBIDDEN` rule or a :data:`LAYERS`
    floor refuses."""
    out = []
    for src, targets in sorted(graph.items()):
        for dst in sorted(targets):
            for a, b, why in FORBIDDEN:
                if _under(src, a) and _under(dst, b):
                    out.append((src, dst, why))
            for layer, allowed, why in LAYERS:
                if _under(src, layer) and not any(_under(dst, p) for p in (layer, *allowed)):
                    out.append((src, dst, why))
    return out


def long_modules(root: Path, max_lines: int) -> list[tuple[str, int]]:
    counts = ((module_name(root, p), len(p.read_text().splitlines())) for p in sorted(root.rglob("*.py")))
    return [(name, n) for name, n in counts if n > max_lines]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent / "unbroken")
    parser.add_argument("--max-lines", type=int, default=600)  # a signal, not a gate: split along meaning
    parser.add_argument("--edges", action="store_true", help="also print every arrow")
    args = parser.parse_args(argv)
    graph = build_graph(args.root)
    if args.edges:
        for src, targets in sorted(graph.items()):
            for dst in sorted(targets):
                print(f"{src} -> {dst}")
    found, bad, long = cycles(graph), forbidden_arrows(graph), long_modules(args.root, args.max_lines)
    for component in found:
        print("cycle: " + " <-> ".join(component))
    for src, dst, why in bad:
        print(f"forbidden: {src} -> {dst} ({why})")
    for name, n in long:
        print(f"too long: {name} has {n} lines (limit {args.max_lines})")
    print(f"{len(graph)} modules, {sum(map(len, graph.values()))} arrows: {len(found)} cycle(s), "
          f"{len(bad)} forbidden arrow(s), {len(long)} module(s) over {args.max_lines} lines")
    return 1 if found or bad or long else 0


if __name__ == "__main__":
    raise SystemExit(main())
