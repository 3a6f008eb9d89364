"""The C loop of a restore from the keeper's memory (``csrc/held_read.c``): built at set-up, loaded with
ctypes, the Python loop (``held.read_checked``) where it is not built.

``scripts/setup.sh`` runs ``python -m slurm_omni.checkpoint.held_native``, which compiles it into the
checkout's git-ignored ``build/held-read/``, under a name that carries a hash of its sources and flags:
a library built from other sources is never loaded (the sources changed since: build it again).
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

from slurm_omni.native import BUILD_ROOT, BuildError, build_hashed, hashed_path

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = (CSRC / "held_read.c", CSRC / "one_pass.h", CSRC / "xxh3_x86.h", CSRC / "xxhash.h")
BUILD_DIR = BUILD_ROOT / "held-read"
CFLAGS = ("-O3", "-std=gnu11", "-Wall", "-Wextra", "-Werror", "-Wformat=2", "-Wshadow",
          "-fstack-protector-strong", "-D_FORTIFY_SOURCE=2", "-fPIC", "-shared", "-fvisibility=hidden",
          "-Wl,-z,relro,-z,now")
"""As spank/Makefile's, plus a shared library's; only ``omni_*`` is exported."""
ABI = 4
__all__ = ["BuildError", "build", "describe", "library_path", "load"]
KERNELS = ("SSE2", "AVX2", "AVX-512")
"""xxh3's kernel the library chose for this CPU, by ``omni_held_read_kernel()``."""


def library_path(dest: Path | None = None) -> Path:
    """Where the library built from today's sources and flags is (or would be)."""
    return hashed_path(SOURCES, CFLAGS, BUILD_DIR if dest is None else dest, "libomni_held_read", ".so")


def build(dest: Path | None = None) -> Path:
    """The library compiled into ``dest`` (nothing to do when it is there already); replaced by a
    rename, never rewritten while a process may have it loaded."""
    return build_hashed(SOURCES, CFLAGS, BUILD_DIR if dest is None else dest, "libomni_held_read", ".so")


def load(dest: Path | None = None) -> tuple[ctypes.CDLL | None, str]:
    """The built library, its functions typed, and ""; else None and why (one line)."""
    dest = BUILD_DIR if dest is None else dest
    try:
        path = library_path(dest)
    except OSError as e:
        return None, f"couldn't read its sources: {e}"
    if not path.exists():
        return None, f"not built ({path.name} is not in {dest}; scripts/setup.sh builds it)"
    try:
        lib = ctypes.CDLL(str(path))   # a CDLL call releases the GIL for its whole length
        if lib.omni_held_read_abi() != ABI:
            return None, f"{path} is not ABI {ABI}"
        fn = lib.omni_read_hashed
        lib.omni_held_read_kernel.restype = ctypes.c_int
        lib.omni_held_read_one_pass.restype = ctypes.c_int
    except (OSError, AttributeError) as e:
        return None, f"couldn't load {path}: {e}"
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t,
                   ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t)]
    try:
        read_plan, publish = lib.omni_read_plan, lib.omni_plan_publish
    except AttributeError as e:
        return None, f"couldn't load {path}: {e}"
    read_plan.restype = ctypes.c_size_t
    read_plan.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    publish.restype = None
    publish.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_int]
    return lib, ""


def describe(lib: ctypes.CDLL | None) -> str:
    """Which loop a restore from the keeper's memory runs (for the bench's lines)."""
    if lib is None:
        return "the Python loop (held.read_checked)"
    own = "; inherited copies: the one pass" if lib.omni_held_read_one_pass() else ""
    return f"the C loop (csrc/held_read.c, xxh3 {KERNELS[lib.omni_held_read_kernel()]}{own})"


def main() -> int:
    try:
        print(f"checkpoint: built {build()}")
    except BuildError as e:
        print(f"checkpoint: the memory tier's C restore loop: {e} (restores from memory use the Python loop)",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
