"""The built-in trainer and the example are users of the public API, nothing more (issue 10).

``omni train`` (slurm_omni/cli/train.py and the trainer module slurm_omni/runtime/loop.py) may import
the public API (``slurm_omni.elastic``, through the package: ``from slurm_omni import elastic``), the
built-in model's own code (its model, data and pipeline modules), its config (the job file's
``[training]`` table) and the error types; examples/own-script/train.py may import only the public API.
Read from the source (ast): every import, at module level or inside a function, counts.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

PUBLIC_API = {"slurm_omni.elastic"}
BUILTIN_OWN_CODE = {"slurm_omni.runtime.model", "slurm_omni.runtime.data", "slurm_omni.runtime.pipeline",
                    "slurm_omni.runtime.loop", "slurm_omni.config.training", "slurm_omni.errors"}
"""The built-in trainer's "user code": what an own script would have in its own files."""

ALLOWED = {
    "slurm_omni/cli/train.py": PUBLIC_API | BUILTIN_OWN_CODE,
    "slurm_omni/runtime/loop.py": PUBLIC_API | BUILTIN_OWN_CODE,
    "slurm_omni/runtime/pipeline.py": PUBLIC_API | BUILTIN_OWN_CODE,
    "slurm_omni/runtime/model.py": PUBLIC_API | BUILTIN_OWN_CODE,
    "slurm_omni/runtime/data.py": PUBLIC_API | BUILTIN_OWN_CODE,
    "examples/own-script/train.py": PUBLIC_API,
}
USERS = ("slurm_omni/cli/train.py", "slurm_omni/runtime/loop.py", "examples/own-script/train.py")
"""The programs: each gets its run from ``elastic.init``."""


def slurm_omni_imports(path: Path) -> set[str]:
    """Every ``slurm_omni...`` module the file imports; ``from slurm_omni import x`` counts as
    ``slurm_omni.x`` (x is a module of the package or a name the package exports)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "slurm_omni"}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "slurm_omni":
                found |= {f"slurm_omni.{a.name}" for a in node.names}
            elif node.module.startswith("slurm_omni."):
                found.add(node.module)
    return found


@pytest.mark.parametrize("rel", sorted(ALLOWED))
def test_imports_only_the_public_api_and_own_code(rel: str) -> None:
    imports = slurm_omni_imports(ROOT / rel)
    assert rel not in USERS or "slurm_omni.elastic" in imports, f"{rel} does not use slurm_omni.elastic"
    outside = sorted(m for m in imports if m not in ALLOWED[rel])
    assert not outside, f"{rel} imports {outside}; allowed: {sorted(ALLOWED[rel])}"


def test_trainer_uses_the_api_for_what_the_runtime_had_of_its_own() -> None:
    """No copies left beside the API: layout, signals, heartbeat, metrics, exit codes, checkpointing."""
    gone = ["layout", "signals", "heartbeat", "metrics", "exitcodes", "checkpointing"]
    assert [m for m in gone if (ROOT / "slurm_omni" / "runtime" / f"{m}.py").exists()] == []
    for rel in ALLOWED:
        imports = slurm_omni_imports(ROOT / rel)
        assert not {m for m in imports if m.startswith("slurm_omni.elastic.")}, \
            f"{rel} reaches into the API's modules instead of `from slurm_omni import elastic`"


def test_the_check_sees_a_forbidden_import(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("import os\nfrom slurm_omni import elastic\n\ndef f():\n"
                      "    from slurm_omni.runtime.launch import launch_local\n"
                      "    import slurm_omni.checkpoint.engine\n")
    assert slurm_omni_imports(script) == {"slurm_omni.elastic", "slurm_omni.runtime.launch",
                                          "slurm_omni.checkpoint.engine"}


def test_preload_imports_every_module_of_the_api() -> None:
    """What a warm standby imports before it forks trainers (slurm_omni/standby/server.py)."""
    import sys

    from slurm_omni import elastic

    elastic.preload()
    expected = {f"slurm_omni.elastic.{m}" for m in ("checkpointer", "codes", "heartbeat", "layout", "metrics",
                                                     "pipelining", "run", "stop", "timing")}
    assert expected <= set(sys.modules)
    assert elastic.TimedStage.__module__ == "slurm_omni.elastic.pipelining"
