"""C built at set-up into the checkout's git-ignored ``build/``, under a name that carries a hash of its
sources and flags: what was built from other sources is never used (build it again). Used by the memory
tier's restore loop (``checkpoint/held_native.py``) and the one-node read of Slurm
(``slurm/node_read.py``)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

BUILD_ROOT = Path(__file__).resolve().parents[1] / "build"
"""Git-ignored, beside the SPANK plugin's and the light rank's builds."""


class BuildError(Exception):
    """No compiler, or the source did not compile: the message is one line."""


def hashed_path(sources: Sequence[Path], flags: Sequence[str], dest: Path, stem: str, suffix: str = "") -> Path:
    """Where what ``sources`` and ``flags`` build is (or would be): ``dest/STEM.HASH[SUFFIX]``."""
    h = hashlib.sha256(" ".join(flags).encode())
    for src in sources:
        h.update(src.read_bytes())
    return dest / f"{stem}.{h.hexdigest()[:16]}{suffix}"


def build_hashed(sources: Sequence[Path], flags: Sequence[str], dest: Path, stem: str, suffix: str = "",
                 libs: Sequence[str] = ()) -> Path:
    """``sources[0]`` (the others are what it includes) compiled with ``flags`` into :func:`hashed_path`
    (nothing to do when it is there already), linked with ``libs``; put in place by a rename, never
    rewritten while a process may run it; builds of earlier sources removed."""
    out = hashed_path(sources, flags, dest, stem, suffix)
    if out.exists():
        return out
    name = sources[0].name
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise BuildError(f"couldn't compile {name}: no C compiler (cc, gcc or $CC) on PATH")
    dest.mkdir(parents=True, exist_ok=True)
    tmp = dest / f".{out.name}.{os.getpid()}.tmp"
    try:
        proc = subprocess.run([cc, *flags, "-o", str(tmp), str(sources[0]), *libs], capture_output=True, text=True,
                              timeout=120, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise BuildError(f"couldn't compile {name} with {cc}: {e}") from e
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        first = next((line for line in proc.stderr.splitlines() if "error" in line), proc.stderr.strip()[:200])
        raise BuildError(f"couldn't compile {name} with {cc} (exit {proc.returncode}): {first}")
    os.replace(tmp, out)
    for old in dest.glob(f"{stem}.*{suffix}"):   # built from earlier sources: never used again
        if old != out and not old.name.startswith("."):
            old.unlink(missing_ok=True)
    return out
