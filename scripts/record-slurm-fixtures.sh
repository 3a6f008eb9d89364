#!/usr/bin/env bash
# Record what the Slurm boundary reads, from the real daemons of one version, as parser fixtures.
#   bash scripts/record-slurm-fixtures.sh 24.11 [STATE_DIR]
#   (OMNI_RECORD_ONLY=cancelled records only the cancelled het job)
# brings up (or reuses) that version's embedded cluster in STATE_DIR (default .omni/cluster-<version>),
# drives it through the states the parsers must read (idle; down + drain; a het job and an array;
# a requeued het job; a het job cancelled by its user; a node not responding; slurmctld unreachable) and writes
# tests/fixtures/slurm-<version>/. Node states are put back afterwards. Takes about 2 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
version=${1:?usage: record-slurm-fixtures.sh VERSION [STATE_DIR]}
state=${2:-.omni/cluster-$version}
out=tests/fixtures/slurm-$version
omni=.venv/bin/omni
mkdir -p "$out"
$omni cluster up --slurm "$version" --state-dir "$state" ${OMNI_RECORD_PORTS:-} >/dev/null
eval "$($omni cluster env --state-dir "$state")"
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT

wait_for() {  # wait_for SECONDS CMD...: until CMD succeeds
  local deadline=$((SECONDS + $1)); shift
  until "$@"; do [ $SECONDS -lt $deadline ] || { echo "record: timed out: $*" >&2; return 1; }; sleep 0.5; done
}
node_is() { sinfo -h -n "$1" -o %T | grep -q "$2"; }
running() { [ "$(squeue -h -j "$1" -o %T | sort -u)" = RUNNING ]; }
job_gone() { [ -z "$(squeue -h -o %i)" ]; }
scancel --user="$(id -un)" 2>/dev/null || true
wait_for 60 job_gone

# A het job cancelled by its user (its batch shell takes 4 s to stop on SIGTERM): CANCELLED+COMPLETING
# while it stops, then CANCELLED, which plain `squeue --json` no longer lists on 24.11+ (it applies
# squeue's default state filter there) and `squeue --json --states=all` does, until MinJobAge.
record_cancelled() {
  cat > "$work/cancel.sbatch" <<'SCRIPT'
#!/bin/bash
#SBATCH --job-name=fixture-cancel --output=/dev/null
#SBATCH --partition=vision --nodes=1 --nodelist=node1
#SBATCH hetjob
#SBATCH --partition=text --nodes=1 --nodelist=node2
trap 'sleep 4; exit 0' TERM
sleep 600 & wait
SCRIPT
  local job
  job=$(sbatch --parsable "$work/cancel.sbatch" | cut -d';' -f1)
  wait_for 60 running "$job"
  sleep 1
  scancel "$job"
  wait_for 10 bash -c "squeue -h -j $job -o %T | grep -q COMPLETING"
  squeue --json --states=all > "$out/squeue_cancelling.json"
  wait_for 60 job_gone
  squeue --json --states=all > "$out/squeue_cancelled.json"
  squeue --json > "$out/squeue_cancelled_default_filter.json"
}
record_cancelled
if [ "${OMNI_RECORD_ONLY:-}" = cancelled ]; then echo "recorded the cancelled job into $out"; exit 0; fi

scontrol show topology > "$out/topology.txt"
sinfo --json > "$out/sinfo_idle.json"
scontrol show nodes --json > "$out/scontrol_nodes_idle.json"
scontrol show node > "$out/nodes_idle.txt"
squeue --json > "$out/squeue_empty.json"

# A het job (vision on node1, text on node2-3) and a 3-task array on node4, all running.
cat > "$work/het.sbatch" <<'EOF'
#!/bin/bash
#SBATCH --job-name=fixture-het --output=/dev/null --requeue
#SBATCH --partition=vision --nodes=1 --gres=gpu:h100:2 --nodelist=node1
#SBATCH hetjob
#SBATCH --partition=text --nodes=2 --gres=gpu:h100:4 --nodelist=node2,node3
sleep 600
EOF
het=$(sbatch --parsable "$work/het.sbatch" | cut -d';' -f1)
arr=$(sbatch --parsable --job-name=fixture-array --output=/dev/null --array=0-2 --nodelist=node4 \
      --ntasks=1 --wrap 'sleep 600' | cut -d';' -f1)
wait_for 60 running "$het"
wait_for 60 running "$arr"
sinfo --json > "$out/sinfo_allocated.json"
squeue --json > "$out/squeue_het_array.json"
scontrol show node node4 > "$out/node_allocated.txt"

# The het job requeued: PENDING again, restart count 1.
scontrol requeue "$het"
wait_for 30 bash -c "squeue -h -j $het -o '%T %r' | grep -q PENDING"
squeue --json > "$out/squeue_requeued.json"
scancel "$het" "$arr"
wait_for 60 job_gone

# node2 DOWN, node6 drained (idle) while node5 runs a job and is drained (draining).
mix=$(sbatch --parsable --job-name=fixture-mixed --output=/dev/null --nodelist=node5 --ntasks=1 \
      --wrap 'sleep 600' | cut -d';' -f1)
wait_for 60 running "$mix"
scontrol update nodename=node2 state=DOWN reason="omni: drill"
scontrol update nodename=node5,node6 state=DRAIN reason="omni: quarantined"
sinfo --json > "$out/sinfo_down_drain.json"
scontrol show nodes --json > "$out/scontrol_nodes_down_drain.json"
scontrol show node > "$out/nodes_down_drain.txt"
scancel "$mix"
wait_for 60 job_gone
scontrol update nodename=node2,node5,node6 state=RESUME

# node8's slurmd stopped (SIGSTOP): NOT_RESPONDING, then DOWN after SlurmdTimeout.
$omni cluster kill slurmd:node8 --signal STOP --state-dir "$state" >/dev/null
trap '$omni cluster kill slurmd:node8 --signal CONT --state-dir "$state" >/dev/null 2>&1 || true; rm -rf "$work"' EXIT
wait_for 90 node_is node8 "down"
sinfo --json > "$out/sinfo_not_responding.json"
scontrol show node node8 > "$out/node_not_responding.txt"
$omni cluster kill slurmd:node8 --signal CONT --state-dir "$state" >/dev/null
wait_for 60 node_is node8 "^idle$"

# slurmctld stopped: what --json prints when it cannot be reached (and the exit status).
$omni cluster kill slurmctld --signal TERM --state-dir "$state" >/dev/null
sleep 2
set +e
sinfo --json > "$out/sinfo_unreachable.json" 2> "$out/sinfo_unreachable.stderr"
echo "$?" > "$out/sinfo_unreachable.rc"
set -e
$omni cluster up --state-dir "$state" >/dev/null   # restarts slurmctld, state kept

# Node/host names and times vary from machine to machine; the recordings keep them as they were.
sinfo --version > "$out/VERSION"
echo "recorded $(ls "$out" | wc -l) files into $out ($(cat "$out/VERSION"))"
