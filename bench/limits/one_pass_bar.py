"""The memory tier's local bar (issue 22: restore >= 0.9 x a warm memcpy) against the cheapest checked
copy measured here: the one pass (``slurm_omni/checkpoint/csrc/one_pass.h``: each stripe loaded once, stored
non-temporally and fed into XXH3-64 from the same registers) from memory this process addresses, as a
rank would read a keeper buffer it maps or inherits, beside ``bench/ckpt_bench.py``'s memcpy: torch's
``copy_`` between two touched host tensors on its intra-op threads. Both on the same threads, rounds
alternating. Not part of the product: the limit of the restore from inherited copies, which runs this
pass (docs/checkpoint.md "Restore from inherited memory").

    .venv/bin/python bench/limits/one_pass_bar.py [--gib 1] [--rounds 9]

Needs a C compiler and AVX2; without either it prints n/a and why.

2026-12-04 16:56, Intel Xeon (AVX-512), 2 CPUs, the machine quiet (load 0.7), three runs: 1.17, 1.16,
1.15 (torch's copy_ 0.083-0.086 s, the pass 0.072-0.074 s); with the default suite's CI beside it
0.91, 1.28, 1.31. The restore from the keeper's memory today (process_vm_readv, then xxh3) in the same
quiet minute: 0.84 (``bench/ckpt_bench.py --memory``).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import ctypes
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

HERE = Path(__file__).resolve().parent
CSRC = HERE.parent.parent / "slurm_omni" / "checkpoint" / "csrc"


def build(into: Path) -> ctypes.CDLL | str:
    """The one pass's library (compiled by the project's own hashed build, ``slurm_omni.native``), or
    why not (one line)."""
    from slurm_omni.native import BuildError, build_hashed

    sources = (HERE / "one_pass_lib.c", CSRC / "one_pass.h", CSRC / "xxh3_x86.h", CSRC / "xxhash.h")
    try:
        out = build_hashed(sources, ("-O3", "-std=gnu11", "-shared", "-fPIC", "-fvisibility=hidden", f"-I{CSRC}"),
                           into, "libone_pass", ".so")
    except BuildError as e:
        return str(e)
    lib = ctypes.CDLL(str(out))
    if not lib.omni_one_pass_ok():
        return "this CPU has no AVX2"
    lib.omni_one_pass.restype = ctypes.c_uint64
    lib.omni_one_pass.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    return lib


@contextlib.contextmanager
def built(prefix: str) -> Iterator[ctypes.CDLL | str]:
    """:func:`build` into a folder of its own, removed after the block."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        yield build(Path(tmp))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    import torch
    import xxhash

    with built("one-pass-") as lib:
        if isinstance(lib, str):
            print(f"one pass / memcpy: n/a ({lib})")
            return 0
        threads = torch.get_num_threads()
        n = int(args.gib * (1 << 30)) // (threads * 4096) * threads * 4096
        src, dst = torch.empty(n, dtype=torch.uint8), torch.empty(n, dtype=torch.uint8)
        src.random_(0, 256)
        dst.fill_(1)
        share = n // threads
        head = 8 << 20
        if lib.omni_one_pass(dst.data_ptr(), src.data_ptr(), head) != \
                xxhash.xxh3_64(src[:head].numpy().tobytes()).intdigest():
            print("one pass: its digest is not XXH3-64's: nothing measured", file=sys.stderr)
            return 1
        copy_s: list[float] = []
        pass_s: list[float] = []
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            for r in range(args.rounds):
                for which in ((0, 1) if r % 2 == 0 else (1, 0)):
                    t0 = time.perf_counter()
                    if which == 0:
                        dst.copy_(src)
                    else:   # one share per thread, each its own digest (a restore hashes per tensor)
                        list(pool.map(lambda k: lib.omni_one_pass(dst.data_ptr() + k * share,
                                                                  src.data_ptr() + k * share, share),
                                      range(threads)))
                    (copy_s if which == 0 else pass_s).append(time.perf_counter() - t0)
        c, p = statistics.median(copy_s), statistics.median(pass_s)
        print(f"{n / 2**30:.2f} GiB, {threads} threads, {args.rounds} rounds: torch copy_ {c:.4f} s, "
              f"one pass (copy + XXH3-64) {p:.4f} s")
        print(f"one pass / memcpy (as ckpt_bench's ratio: memcpy s / this s): {c / p:.2f}; per round "
              + ", ".join(f"{a / b:.2f}" for a, b in zip(copy_s, pass_s, strict=True)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
