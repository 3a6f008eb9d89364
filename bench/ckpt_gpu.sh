#!/usr/bin/env bash
# The checkpoint engine's GPU check, one command on a GPU machine (no install: PYTHONPATH=.):
#   bash bench/ckpt_gpu.sh            # or GIB=8 TENSORS=800 REPEAT=5 OUT=/some/dir bash bench/ckpt_gpu.sh
# Runs the CUDA tests (device round trip, CUDA RNG), then bench/ckpt_bench.py on CUDA state and on host
# state; each prints its table and the five ratios against the bars of issue 3.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
out=${OUT:-/tmp}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/ckpt/test_ckpt_cuda.py tests/ckpt/test_ckpt_roundtrip.py
python3 bench/ckpt_bench.py --device cuda --gib "${GIB:-4}" --tensors "${TENSORS:-600}" --repeat "${REPEAT:-5}" \
    --json "$out/ckpt_bench_cuda.json"
python3 bench/ckpt_bench.py --device cpu --gib 1 --tensors 300 --repeat "${REPEAT:-5}" --json "$out/ckpt_bench_cpu.json"
