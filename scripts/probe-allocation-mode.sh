#!/usr/bin/env bash
# What allocation mode (docs/allocation-mode.md) needs from the Slurm on PATH / SLURM_CONF, probed on
# an idle embedded cluster (eval "$(omni cluster env --state-dir DIR)" first): an allocation with no
# batch script, its first node lost, a step from outside afterwards, and whether a running job can
# be grown (job expansion), or the 24.05+ step manager asked for. Sets one node DOWN and resumes it;
# cancels only the jobs it made (by id). Recorded results: docs/slurm-versions.md.
set -u
echo "== $(sinfo --version)"
out=$(salloc --no-shell --no-kill -N 3 -J probe-alloc -t 5 2>&1); echo "salloc --no-shell --no-kill -N 3: $out"
J=$(echo "$out" | grep -o 'job allocation [0-9]*' | awk '{print $3}')
[ -n "$J" ] || { echo "no allocation"; exit 1; }
ours=("$J")
trap 'scancel "${ours[@]}" 2>/dev/null; [ -n "${first:-}" ] && scontrol update nodename="$first" state=RESUME' EXIT
sleep 1
scontrol show job -o "$J" | tr ' ' '\n' | grep -E '^(JobState|BatchFlag|BatchHost|NodeList)='
first=$(scontrol show hostnames "$(squeue -h -j "$J" -o %N)" | head -1)
scontrol update nodename="$first" state=DOWN reason=probe-allocation-mode
sleep 3
echo "-- after $first DOWN:"; scontrol show job -o "$J" | tr ' ' '\n' | grep -E '^(JobState|NodeList|BatchHost|NumNodes)='
echo "-- srun --jobid=$J -N2 from outside:"; timeout 30 srun --jobid="$J" -N2 hostname 2>&1 | sed 's/^/  /'
echo "-- grow: salloc --no-shell -N1 --dependency=expand:$J"
out=$(timeout 15 salloc --no-shell -N1 --dependency=expand:"$J" -t 5 -J probe-expand 2>&1); echo "  $out"
E=$(echo "$out" | grep -o 'job allocation [0-9]*' | awk '{print $3}'); [ -n "$E" ] && ours+=("$E")
echo "-- grow: scontrol update jobid=$J NumNodes=3:"; scontrol update jobid="$J" NumNodes=3 2>&1 | sed 's/^/  /'
echo "-- salloc --stepmgr:"
out=$(timeout 15 salloc --no-shell --stepmgr -N1 -t 1 -J probe-stepmgr 2>&1); echo "  $out"
S=$(echo "$out" | grep -o 'job allocation [0-9]*' | awk '{print $3}'); [ -n "$S" ] && ours+=("$S")
exit 0
