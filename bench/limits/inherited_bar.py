"""The memory tier's local restore from inherited memory (issue 22, docs/checkpoint.md "Restore from
inherited memory", measured here before it was built): a process that holds a step's copy (as the standby server would hold the node's
HeldStore) forks the process that restores (as it forks every relaunched trainer), and the child reads
the copy at the address it inherited with the one pass (``csrc/one_pass.h``: copy + XXH3-64,
non-temporal stores), beside torch's ``copy_`` of the same bytes between two of its own touched tensors
(``bench/ckpt_bench.py``'s memcpy). Then what the holder pays to write its next step into the same
buffer, which the child shared copy-on-write: while the child still maps it, after the child dropped it
(``MADV_DONTNEED``), and never forked (the same write before the fork). Not part of the product: the
measurements the design needed, kept as the limit of the restore that is built on it.

    .venv/bin/python bench/limits/inherited_bar.py [--gib 1] [--rounds 7]

Needs a C compiler and AVX2 (else n/a and why) and Linux (fork, madvise).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import ctypes
import mmap
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from one_pass_bar import built

HUGE = 2 << 20


def write_s(addr: int, n: int, value: int) -> float:
    """Seconds to write ``n`` bytes at ``addr`` (the holder's next step)."""
    t0 = time.perf_counter()
    ctypes.memset(addr, value, n)
    return time.perf_counter() - t0


def child(addr: int, n: int, rounds: int, lib: ctypes.CDLL, drop: bool, out: int) -> None:
    """Read the inherited copy; report on ``out``; drop the mapping's pages when ``drop``."""
    import torch

    threads = torch.get_num_threads()
    share = n // threads
    dst, own = torch.empty(n, dtype=torch.uint8), torch.empty(n, dtype=torch.uint8)
    dst.fill_(1)
    ctypes.memmove(own.data_ptr(), addr, n)   # the same bytes, this process's own
    copy_s: list[float] = []
    pass_s: list[float] = []
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        for r in range(rounds):
            for which in ((0, 1) if r % 2 == 0 else (1, 0)):
                t0 = time.perf_counter()
                if which == 0:
                    dst.copy_(own)
                else:
                    list(pool.map(lambda k: lib.omni_one_pass(dst.data_ptr() + k * share, addr + k * share, share),
                                  range(threads)))
                (copy_s if which == 0 else pass_s).append(time.perf_counter() - t0)
    import xxhash

    head = min(n, 8 << 20)
    digest = lib.omni_one_pass(dst.data_ptr(), addr, head)
    if digest != xxhash.xxh3_64(ctypes.string_at(addr, head)).intdigest() or not torch.equal(dst, own):
        os.write(out, b"error: the one pass's copy or digest differs from the inherited bytes' own\n")
        return
    if drop:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(n), 4) != 0:   # MADV_DONTNEED
            os.write(out, f"error madvise: {os.strerror(ctypes.get_errno())}\n".encode())
    os.write(out, f"{threads} {statistics.median(copy_s)} {statistics.median(pass_s)}\n".encode())
    os.read(0, 1)   # held until the holder wrote its next step (it closes the pipe)


def one(lib: ctypes.CDLL, n: int, rounds: int, drop: bool) -> tuple[str, float, float, float, float]:
    """One fork: (threads, copy_ s, one pass s, the holder's write s before the fork, after the child read)."""
    region = mmap.mmap(-1, n + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = ctypes.addressof(ctypes.c_char.from_buffer(region))
    addr = (base + HUGE - 1) // HUGE * HUGE
    if hasattr(mmap, "MADV_HUGEPAGE"):
        region.madvise(mmap.MADV_HUGEPAGE)
    chunk = os.urandom(64 << 20)
    for off in range(0, n, len(chunk)):
        ctypes.memmove(addr + off, chunk, min(len(chunk), n - off))
    before = statistics.median(write_s(addr, n, v) for v in (3, 5, 7))
    for off in range(0, n, len(chunk)):   # the step's bytes again (the writes above overwrote them)
        ctypes.memmove(addr + off, chunk, min(len(chunk), n - off))
    r, w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        os.close(go_w)
        os.dup2(go_r, 0)
        try:
            child(addr, n, rounds, lib, drop, w)
        finally:
            os._exit(0)
    os.close(w)
    line = b""
    while not line.endswith(b"\n"):
        part = os.read(r, 4096)
        if not part:
            break
        line += part
    after = write_s(addr, n, 9)   # the child reads nothing more; it holds the pages unless it dropped them
    os.close(go_w)
    os.waitpid(pid, 0)
    os.close(r)
    os.close(go_r)
    del chunk
    text = line.decode().strip()
    if text.startswith("error"):
        raise OSError(text)
    threads, copy_s, pass_s = text.split()
    return threads, float(copy_s), float(pass_s), before, after


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    with built("inherited-") as lib:
        if isinstance(lib, str):
            print(f"inherited one pass / memcpy: n/a ({lib})")
            return 0
        n = int(args.gib * (1 << 30)) // HUGE * HUGE
        for drop in (True, False):
            threads, c, p, before, after = one(lib, n, args.rounds, drop)
            print(f"{n / 2**30:.2f} GiB, {threads} threads, {args.rounds} rounds; the child "
                  f"{'dropped the inherited pages (MADV_DONTNEED)' if drop else 'still maps the inherited pages'}")
            print(f"  restore from the inherited copy, one pass / torch copy_ (memcpy s / this s): {c / p:.2f} "
                  f"(copy_ {c:.4f} s, one pass {p:.4f} s)")
            print(f"  the holder's next write, after / never forked: {after / before:.2f} "
                  f"({after:.4f} s against {before:.4f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
