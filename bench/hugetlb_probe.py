"""What a memory-tier restore that maps the keeper's memory could reach (issue 22's next step): 1 GiB
copied by torch (its intra-op threads) from a second mapping of a memfd, as another process maps the
keeper's (``MAP_POPULATE`` and the copy timed together), against a warm anonymous-to-anonymous copy.

    .venv/bin/python bench/hugetlb_probe.py [--huge] [--repeat 7]

``--huge`` adds a memfd in 2 MiB huge pages (``MFD_HUGETLB``), which needs a pool the administrator
reserves (``/proc/sys/vm/nr_hugepages``, 512 pages per GiB); without one it prints n/a and why. A probe,
not the product's path: the restore reads with ``process_vm_readv`` (checkpoint/held.py).
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import time

import torch

SIZE = 1 << 30


def written_memfd(flags: int) -> int:
    """A memfd of ``SIZE`` bytes, written through a mapping of its own (the keeper's copy)."""
    fd = os.memfd_create("omni-probe", flags)
    os.ftruncate(fd, SIZE)
    with mmap.mmap(fd, SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as m:
        torch.frombuffer(m, dtype=torch.uint8).fill_(7)
    return fd


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--huge", action="store_true", help="Also a memfd in 2 MiB pages (needs nr_hugepages).")
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    src = torch.full((SIZE,), 7, dtype=torch.uint8)
    dst = torch.ones(SIZE, dtype=torch.uint8)
    kinds = {"memfd, 4 KiB pages": 0}
    if args.huge:
        kinds["memfd, 2 MiB pages (hugetlb)"] = os.MFD_HUGETLB
    fds: dict[str, int] = {}
    for name, flags in kinds.items():
        try:
            fds[name] = written_memfd(flags)
        except OSError as e:
            print(f"{name}: n/a ({e}: reserve a pool, e.g. echo 600 > /proc/sys/vm/nr_hugepages, as root)")
    rows: dict[str, list[float]] = {k: [] for k in ["memcpy", *fds]}
    for _ in range(args.repeat):
        t = time.perf_counter()
        dst.copy_(src)
        rows["memcpy"].append(time.perf_counter() - t)
        for name, fd in fds.items():
            t = time.perf_counter()
            with mmap.mmap(fd, SIZE, mmap.MAP_SHARED | mmap.MAP_POPULATE, mmap.PROT_READ | mmap.PROT_WRITE) as m:
                view = torch.frombuffer(m, dtype=torch.uint8)
                dst.copy_(view)
                del view
            rows[name].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in rows.items()}
    print(f"1 GiB, {torch.get_num_threads()} threads, medians of {args.repeat}, load {os.getloadavg()[0]:.1f}: "
          + ", ".join(f"{k} {v * 1000:.1f} ms" for k, v in med.items()))
    for name in fds:
        print(f"  memcpy / (map + populate + copy from the {name}) = {med['memcpy'] / med[name]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
