#!/usr/bin/env bash
# Set up everything, then run the whole test suite against the embedded Slurm cluster.
# The cluster is stopped afterwards (OMNI_KEEP_CLUSTER=1 keeps it for the next run).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
if [ "${OMNI_KEEP_CLUSTER:-0}" != 1 ]; then
  trap 'omni cluster down >/dev/null 2>&1 || true' EXIT
fi
omni cluster up
python -m pytest -p no:cacheprovider "$@"
