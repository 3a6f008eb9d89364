#!/usr/bin/env bash
# Set up everything, bring the embedded Slurm cluster up and run the demo job.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
omni cluster up
eval "$(omni cluster env)"
omni demo "$@"
