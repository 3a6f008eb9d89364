"""Rank 0 of an old incarnation saving one step, run by test_ckpt_staging as a process of its own.

It stops itself (SIGSTOP, as a network partition stops a node) the moment its commit has every
rank's shard record and before it looks at the fence again: the test resumes it (SIGCONT) once the
next incarnation has started and begun writing the same step. Prints the save's outcome."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

from ckpt.states import engine
from ckpt.test_ckpt_ranks import layout, state_of
from slurm_omni.checkpoint import persist


def main(root: str, step: int, number: int) -> None:
    awaited = persist._await_records

    def then_stop(*args: Any, **kwargs: Any) -> Any:
        records = awaited(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGSTOP)
        return records

    persist._await_records = then_stop   # type: ignore[assignment]
    lay = layout(0, dp=1)
    with engine(Path(root), layout=lay, incarnation=str(number), incarnation_number=number,
                commit_timeout_s=120) as eng:
        stats = eng.save(step, state_of(lay, step + 1000), sync=True).persisted.result()
    print(json.dumps({"fenced": stats.fenced, "committed": stats.committed}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
