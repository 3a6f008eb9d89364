"""The scale lane's C light rank (``bench/light_rank.c``), compiled where the bench runs.

``bench/light_rank.py`` is the reference and its docstring the contract; the C rank keeps it
(tests/supervisor/test_light_rank.py runs the contract tests on both) at a fraction of the CPU
(a rank's start and its steady state: docs/in-allocation.md, "Scale").
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

SOURCES = tuple(Path(__file__).resolve().parent / f for f in ("light_rank.c", "light_relay.c", "light_io.c"))
"""The rank, its node aggregation, its bytes and files (and light_rank.h, which they share)."""
PYTHON_RANK = Path(__file__).resolve().parent / "light_rank.py"
BUILD_DIR = Path(__file__).resolve().parents[1] / "build" / "light-rank"
"""Git-ignored (``build/``)."""
CFLAGS = ("-O2", "-std=gnu11", "-Wall", "-Wextra", "-Werror", "-Wformat=2", "-Wshadow",
          "-fstack-protector-strong", "-D_FORTIFY_SOURCE=2")
"""As spank/Makefile's: a warning is an error, so a compiler that finds one says so here."""


class BuildError(Exception):
    """No compiler, or the source did not compile: the message is one line."""


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def build(dest: Path = BUILD_DIR, *, sources: tuple[Path, ...] = SOURCES, extra: tuple[str, ...] = ()) -> Path:
    """``dest``/light_rank compiled from ``sources`` (``extra``: more arguments, such as a test
    harness's include folder); replaced by a rename, never rewritten while a rank may run it."""
    cc = compiler()
    if cc is None:
        raise BuildError("light rank: couldn't compile bench/light_rank.c: no C compiler (cc, gcc or $CC) on PATH")
    dest.mkdir(parents=True, exist_ok=True)
    out = dest / "light_rank"
    tmp = dest / f".light_rank.{os.getpid()}.tmp"
    try:
        proc = subprocess.run([cc, *CFLAGS, "-o", str(tmp), *map(str, sources), *extra], capture_output=True,
                              text=True, timeout=120, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise BuildError(f"light rank: couldn't compile {sources[0].name} with {cc}: {e}") from e
    if proc.returncode != 0:
        first = next((line for line in proc.stderr.splitlines() if "error" in line), proc.stderr.strip()[:200])
        tmp.unlink(missing_ok=True)
        raise BuildError(f"light rank: couldn't compile {sources[0].name} with {cc} (exit {proc.returncode}): {first}")
    os.replace(tmp, out)
    return out


def rank_argv(kind: str, python: str, dest: Path = BUILD_DIR) -> tuple[list[str], str]:
    """The command of one rank of ``kind`` (``c`` or ``python``) and a line saying which it is; a C
    rank that cannot be built falls back to the Python one, the line says why."""
    if kind == "c":
        try:
            binary = build(dest)
            said = f"C ({binary}, compiled from bench/light_rank.c, light_relay.c, light_io.c: {' '.join(CFLAGS)})"
            return [str(binary)], said
        except BuildError as e:
            return [python, "-S", str(PYTHON_RANK)], f"python -S bench/light_rank.py (the C rank fell back: {str(e).removeprefix('light rank: ')})"
    return [python, "-S", str(PYTHON_RANK)], "python -S bench/light_rank.py (--rank python)"
