"""Imports in ``slurm_omni/manager/`` run one way (issue 20 item 3): the daemon imports recovery,
watch and failslow, and they reach the manager through ``manager/context.py`` below them, never the
daemon. Read from the source (ast): every import counts, under ``TYPE_CHECKING`` or in a function too."""

from __future__ import annotations

import ast
from pathlib import Path

from support import find_cycle

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "slurm_omni.manager"


def manager_imports(path: Path) -> set[str]:
    """The ``slurm_omni.manager`` modules ``path`` imports (``from slurm_omni.manager import x`` is
    module ``x`` when the folder has it)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith(PACKAGE + ".")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == PACKAGE:
                found |= {f"{PACKAGE}.{a.name}" for a in node.names
                          if (path.parent / f"{a.name}.py").exists()}
            elif node.module.startswith(PACKAGE + "."):
                found.add(node.module)
    return found


def import_graph(folder: Path) -> dict[str, set[str]]:
    return {f"{PACKAGE}.{p.stem}": manager_imports(p) for p in sorted(folder.glob("*.py")) if p.stem != "__init__"}


def test_manager_modules_import_without_a_cycle() -> None:
    graph = import_graph(ROOT / "slurm_omni" / "manager")
    assert {f"{PACKAGE}.recovery", f"{PACKAGE}.watch", f"{PACKAGE}.failslow"} <= graph[f"{PACKAGE}.daemon"]
    assert find_cycle(graph) == [], " -> ".join(find_cycle(graph))
    for name in ("recovery", "watch", "failslow", "context"):
        assert f"{PACKAGE}.daemon" not in graph[f"{PACKAGE}.{name}"], name


def test_the_check_sees_a_cycle_through_type_checking_and_function_imports(tmp_path: Path) -> None:
    (tmp_path / "daemon.py").write_text("from slurm_omni.manager import recovery\n")
    (tmp_path / "recovery.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                          "    from slurm_omni.manager.watch import Watch\n")
    (tmp_path / "watch.py").write_text("def f():\n    import slurm_omni.manager.daemon\n")
    assert find_cycle(import_graph(tmp_path)) == [f"{PACKAGE}.daemon", f"{PACKAGE}.recovery", f"{PACKAGE}.watch",
                                                  f"{PACKAGE}.daemon"]
    (tmp_path / "watch.py").write_text("from slurm_omni.manager import context\n")
    assert find_cycle(import_graph(tmp_path)) == []
