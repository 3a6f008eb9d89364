#!/usr/bin/env bash
# Set up everything, then run the whole test suite against the embedded Slurm cluster.
# The cluster is stopped afterwards (OMNI_KEEP_CLUSTER=1 keeps it for the next run).
#   OMNI_SLURM_VERSION=24.11|26.05   the version lane: the tests that cross the Slurm boundary
#                                    (-m cluster) on that version's cluster, in .omni/cluster-<version>
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
version=${OMNI_SLURM_VERSION:-22.05}
if [ "$version" = 22.05 ]; then
  state=${OMNI_CLUSTER_DIR:-.omni/cluster}
  up=(omni cluster up --state-dir "$state")
  select=()
else
  state=${OMNI_CLUSTER_DIR:-.omni/cluster-$version}
  # ports and first job ids apart from the default cluster's (16817/16900, job ids from 1): a
  # job's first MASTER_PORT guesses follow from its id (tests/conftest.py LANE_PORTS, LANE_FIRST_JOB_ID)
  case $version in 24.11) ports=(17017 17100 5001) ;; 26.05) ports=(17217 17300 10001) ;;
    *) echo "test.sh: OMNI_SLURM_VERSION=$version (allowed: 22.05, 24.11, 26.05)" >&2; exit 2 ;; esac
  up=(omni cluster up --slurm "$version" --state-dir "$state")
  [ -f "$state/cluster.json" ] || up+=(--ctld-port "${ports[0]}" --slurmd-base-port "${ports[1]}" \
                                       --first-job-id "${ports[2]}")
  select=(-m cluster)
fi
export OMNI_SLURM_VERSION=$version OMNI_CLUSTER_DIR=$state
if [ "${OMNI_KEEP_CLUSTER:-0}" != 1 ]; then
  trap 'omni cluster down --state-dir "$state" >/dev/null 2>&1 || true' EXIT
fi
"${up[@]}"
python -m pytest -p no:cacheprovider "${select[@]}" "$@"
