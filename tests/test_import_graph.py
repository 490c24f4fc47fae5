"""The layers run one way: scripts/import_graph.py finds no cycle, no forbidden arrow and no
module over the line limit in the package (stdlib ast, milliseconds)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(30)


def _script():
    spec = importlib.util.spec_from_file_location("import_graph", ROOT / "scripts" / "import_graph.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_no_import_cycle_no_forbidden_arrow_no_long_module(capsys):
    graph_tool = _script()
    graph = graph_tool.build_graph(ROOT / "unbroken")
    assert graph_tool.cycles(graph) == []
    assert graph_tool.forbidden_arrows(graph) == []
    assert graph_tool.main(["--root", str(ROOT / "unbroken")]) == 0, capsys.readouterr().out


def test_the_tool_sees_a_cycle_and_an_upward_arrow(tmp_path):
    graph_tool = _script()
    pkg = tmp_path / "unbroken"
    (pkg / "recovery").mkdir(parents=True)
    (pkg / "optim").mkdir()
    for init in (pkg, pkg / "recovery", pkg / "optim"):
        (init / "__init__.py").write_text("")
    (pkg / "recovery" / "a.py").write_text("from unbroken.optim import b\n")
    (pkg / "optim" / "b.py").write_text("if False:\n    from unbroken.recovery.a import x\n")
    graph = graph_tool.build_graph(pkg)
    assert graph_tool.cycles(graph) == [["unbroken.optim.b", "unbroken.recovery.a"]]
    assert [(s, d) for s, d, _ in graph_tool.forbidden_arrows(graph)] == [("unbroken.recovery.a", "unbroken.optim.b")]


def test_the_lowest_layer_imports_only_the_ground_floor_and_comm_not_the_checkpoint_engine(tmp_path):
    graph_tool = _script()
    pkg = tmp_path / "unbroken"
    for sub in ("state", "checkpoint", "comm"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "errors.py").write_text("")
    (pkg / "state" / "tree.py").write_text("from unbroken.errors import X\nfrom unbroken.state import blob\n")
    (pkg / "state" / "blob.py").write_text("from unbroken.checkpoint import files\n")
    (pkg / "checkpoint" / "files.py").write_text("from unbroken.state.tree import flatten_state\n")
    (pkg / "comm" / "p2p.py").write_text("from unbroken.checkpoint.files import x\nfrom unbroken.state.tree import y\n")
    graph = graph_tool.build_graph(pkg)
    assert sorted((s, d) for s, d, _ in graph_tool.forbidden_arrows(graph)) == [
        ("unbroken.comm.p2p", "unbroken.checkpoint.files"), ("unbroken.state.blob", "unbroken.checkpoint.files")]
