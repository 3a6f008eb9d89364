"""The layers import one way (README, CONTRIBUTING): ``policy/`` is pure decision code and imports
nothing that runs a command, reads a process's file or holds a daemon's state; ``formats/`` is the
schemas both sides share and imports neither side; ``supervisor/`` and ``policy/`` have no import
cycle among their own modules (``manager/``'s: tests/manager/test_manager_import_graph.py). Read from
the source (ast): every import counts, under ``TYPE_CHECKING`` or in a function too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from support import find_cycle

ROOT = Path(__file__).resolve().parents[2] / "slurm_omni"

NOT_IN_POLICY = ("slurm_omni.manager", "slurm_omni.supervisor", "slurm_omni.cli", "slurm_omni.drill",
                 "slurm_omni.standby", "slurm_omni.runtime", "slurm_omni.cluster", "slurm_omni.render",
                 "slurm_omni.fsio", "slurm_omni.formats", "slurm_omni.slurm.runner", "slurm_omni.slurm.steps",
                 "slurm_omni.slurm.allocation", "slurm_omni.slurm.cli_backend", "slurm_omni.slurm.salloc")
NOT_IN_FORMATS = ("slurm_omni.manager", "slurm_omni.supervisor", "slurm_omni.cli", "slurm_omni.drill",
                  "slurm_omni.slurm.runner")


def imports(path: Path) -> set[str]:
    """Every ``slurm_omni`` module ``path`` imports (``from a import b`` counts as ``a.b`` too)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("slurm_omni")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and node.module.startswith("slurm_omni"):
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return found


def module(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def graph(folder: Path) -> dict[str, set[str]]:
    mods = {module(p): p for p in sorted(folder.glob("*.py"))}
    return {name: {m for m in imports(p) if m in mods and m != name} for name, p in mods.items()}


@pytest.mark.parametrize(("folder", "banned"), [("policy", NOT_IN_POLICY), ("formats", NOT_IN_FORMATS)])
def test_a_layer_imports_nothing_above_it(folder: str, banned: tuple[str, ...]) -> None:
    wrong = sorted(f"{module(p)} imports {m}" for p in sorted((ROOT / folder).glob("*.py"))
                   for m in imports(p) if m.startswith(banned))
    assert wrong == []


@pytest.mark.parametrize("folder", ["policy", "supervisor", "formats"])
def test_a_folders_modules_import_without_a_cycle(folder: str) -> None:
    g = graph(ROOT / folder)
    assert len(g) > 3 and find_cycle(g) == [], " -> ".join(find_cycle(g))


def test_the_checks_see_a_banned_import_in_a_function_and_a_cycle(tmp_path: Path) -> None:
    pkg = tmp_path / "slurm_omni" / "policy"
    pkg.mkdir(parents=True)
    (pkg / "a.py").write_text("def f():\n    from slurm_omni.slurm.runner import CommandRunner\n"
                              "from slurm_omni.policy import b\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                              "    from slurm_omni.policy.a import f\n")
    assert "slurm_omni.slurm.runner" in imports(pkg / "a.py")
    mods = {p.stem: imports(p) for p in pkg.glob("*.py")}
    g = {f"slurm_omni.policy.{k}": {m for m in v if m.rsplit(".", 1)[-1] in mods and m.startswith("slurm_omni.policy.")}
         for k, v in mods.items()}
    assert find_cycle(g) == ["slurm_omni.policy.a", "slurm_omni.policy.b", "slurm_omni.policy.a"]
