"""Inputs and stub Slurm commands of the template tests."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DATA = Path(__file__).with_name("data")
GOLDEN = Path(__file__).with_name("golden")
# Where the golden scripts say the job file lives: fixed, so goldens do not depend on the checkout.
JOB_FILE = Path("/shared/jobs/omni-tiny/job.toml")


STUB_SRUN = r"""#!/bin/bash
# Records its argv and environment, then behaves as STUB_MODE says.
printf '%s\0' "$@" > "$STUB_OUT/argv"
env -0 > "$STUB_OUT/env"
case $STUB_MODE in
    exit:*) exit "${STUB_MODE#exit:}" ;;
    terminated-on-usr1)   # killed by srun's TERM after another rank exited 75 (--kill-on-bad-exit)
        trap 'echo USR1 >> "$STUB_OUT/signals"; trap - TERM; kill -TERM $$' USR1
        touch "$STUB_OUT/ready"
        for _ in $(seq 300); do sleep 0.1; done
        exit 1 ;;
    checkpoint-on-signal)
        trap 'echo USR1 >> "$STUB_OUT/signals"; exit 75' USR1
        trap 'echo TERM >> "$STUB_OUT/signals"; exit 75' TERM
        touch "$STUB_OUT/ready"
        for _ in $(seq 300); do sleep 0.1; done
        exit 1 ;;
esac
"""

STUB_SCONTROL = r"""#!/bin/bash
case "$1 $2" in
    "show hostnames") printf 'node1\nnode2\n' ;;
    "show node") echo "NodeName=$4 Arch=x86_64 NodeAddr=10.1.2.3 NodeHostName=h1" ;;
    requeue*) echo "$2" >> "$STUB_OUT/requeue" ;;
    *) echo "stub scontrol: unexpected $*" >&2; exit 1 ;;
esac
"""


