#!/usr/bin/env bash
# The runtime's NCCL/CUDA path on a GPU machine, in under 4 minutes; prints figures.
#
# Needs: this checkout, and a Python >= 3.11 with a CUDA build of torch >= 2.13 plus h5py, numpy, click,
# xxhash (the runtime's imports). It looks for one in $OMNI_PYTHON, ./.venv/bin/python, python3, and
# runs the code from the checkout through PYTHONPATH (nothing is installed). If the Python with CUDA
# torch lacks the other packages, it makes a fresh venv over that Python's site-packages and runs
# `pip install -e .` there (needs the package index; torch itself is reused, not downloaded).
#
# What runs (OMNI_DEVICE=cuda, backend nccl):
#  1. one rank holding both stages (colocated; NCCL refuses two ranks on one GPU), preset "base",
#     stopped with SIGUSR1 at step 6 (sync checkpoint, exit 75) and resumed to step 12;
#  2. with >= 2 GPUs: the split pipeline, vision rank on GPU 0 and text rank on GPU 1 over NCCL
#     send/recv, GPipe and 1F1B, with the bubble figures from bench/elastic_bench.py;
#  3. with >= 4 GPUs: dp=2 (4 ranks) stopped at step 6 and resumed with dp=1 (shrink), ratio printed.
# Usage: bash bench/gpu_runtime_check.sh [OUT_DIR]     (default: bench/out/gpu, or $OUT when set)
# OMNI_CHECK_DRY_RUN=1 runs the same steps on CPU/gloo with the tiny preset (to test this script;
# OMNI_CHECK_GPUS=4 also walks the multi-GPU branches there).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
out=${1:-${OUT:-bench/out/gpu}}
mkdir -p "$out"
out=$(cd "$out" && pwd)

has_cuda_torch() { "$1" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; }
has_deps() { "$1" -c 'import h5py, numpy, click, xxhash' 2>/dev/null; }

dry=${OMNI_CHECK_DRY_RUN:-0}
if [[ "$dry" == 1 ]]; then has_cuda_torch() { "$1" -c 'import torch' 2>/dev/null; }; fi
py=""
for cand in "${OMNI_PYTHON:-}" "$repo/.venv/bin/python" "$(command -v python3 || true)"; do
    if [[ -n "$cand" && -x "$cand" ]] && has_cuda_torch "$cand"; then py=$cand; break; fi
done
if [[ -z "$py" ]]; then
    echo "gpu-check: no Python with a CUDA build of torch (set OMNI_PYTHON)" >&2
    exit 2
fi
if ! has_deps "$py"; then
    venv="$out/venv"
    "$py" -m venv --system-site-packages "$venv"
    "$venv/bin/pip" install -q -e "$repo"
    py="$venv/bin/python"
fi
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
export OMNI_LOG_LEVEL=WARNING OMNI_CHECK_DRY_RUN="$dry"
if [[ "$dry" == 1 ]]; then export OMNI_DEVICE=cpu OMNI_CHECK_PRESET=tiny; else export OMNI_DEVICE=cuda; fi
"$py" - <<'EOF'
import torch
if torch.cuda.is_available():
    print(f"gpu-check: torch {torch.__version__} cuda {torch.version.cuda} "
          f"nccl {'.'.join(map(str, torch.cuda.nccl.version()))} "
          f"gpus {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}")
else:
    print(f"gpu-check: torch {torch.__version__}, no CUDA (dry run on CPU)")
EOF

timeout 220 "$py" - "$out" <<'EOF'
import json, os, shutil, signal, statistics, subprocess, sys, time
from pathlib import Path

import torch

from slurm_omni.runtime.launch import launch_local
from slurm_omni.elastic.metrics import read_jsonl
from slurm_omni.runtime.synth import SynthSpec, write_shards
from slurm_omni.config.training import ModelConfig

out = Path(sys.argv[1])
device = os.environ["OMNI_DEVICE"]
gpus = torch.cuda.device_count() if device == "cuda" else int(os.environ.get("OMNI_CHECK_GPUS", "0"))
preset = os.environ.get("OMNI_CHECK_PRESET", "base")
model = ModelConfig(preset=preset)
write_shards(SynthSpec(out_dir=out / "shards", pairs=192, text=64, shard_size=64, image_size=model.image_size,
                       seq_len=model.seq_len, vocab_size=model.vocab_size))
JOB = f"""[training]
max_steps = 12
[training.model]
preset = "{preset}"
[training.parallel]
schedule = "{{schedule}}"
global_batch_size = 16
micro_batch_size = 4
[training.data]
shard_dir = "{out / 'shards'}"
[[training.data.sources]]
name = "pairs"
weight = 3
[[training.data.sources]]
name = "text"
weight = 1
[training.checkpoint]
every_steps = 4
"""


def job(schedule):
    p = out / f"job-{schedule}.toml"
    p.write_text(JOB.format(schedule=schedule))
    return p


def launch(cfg, run_dir, dp, colocated, incarnation=0, stop_at=None):
    # A stopped phase is paced (sleep after each step, outside the measured step time) so that the
    # signal lands mid-run.
    env = {"OMNI_HEARTBEAT_INTERVAL": "0.1", "OMNI_STEP_DELAY_S": "0.3" if stop_at is not None else "0"}
    h = launch_local(cfg, data_parallel_size=dp, run_dir=run_dir, colocated=colocated, incarnation=incarnation,
                     extra_env=env)
    if stop_at is not None:
        hb = run_dir / "heartbeat" / "rank-0.json"
        while all(p.poll() is None for p in h.procs):
            rec = read_jsonl(hb)
            if rec and rec[0]["incarnation"] == incarnation and rec[0]["step"] >= stop_at:
                h.send(signal.SIGUSR1)
                break
            time.sleep(0.05)
    codes = h.wait(150)
    if any(c not in (0, 75) for c in codes):
        print(h.logs()[-4000:])
        raise SystemExit(f"gpu-check: {run_dir.name}: ranks exited {codes}")
    return codes


def summary(run_dir, name):
    recs = read_jsonl(run_dir / "metrics" / f"metrics-{name}.jsonl")
    steady = [r for r in recs if r["step"] > 2] or recs
    med = lambda k: statistics.median(r[k] for r in steady if r.get(k) is not None)  # noqa: E731
    blocking = [r["ckpt_blocking_seconds"] for r in recs if r.get("ckpt_blocking_seconds") is not None]
    persist = [r["ckpt_persist_seconds"] for r in recs if r.get("ckpt_persist_seconds") is not None]
    return {"steps": f"{recs[0]['step']}..{recs[-1]['step']}", "loss_first": recs[0].get("loss"),
            "loss_last": recs[-1].get("loss"), "step_s": med("step_time_seconds"),
            "global_samples_per_s": med("global_samples_per_second"), "tokens_per_s": med("tokens_per_second"),
            "ckpt_blocking_s_max": max(blocking, default=None), "ckpt_persist_s_max": max(persist, default=None)}


results = {}
run = out / "colocated"
shutil.rmtree(run, ignore_errors=True)
c1 = launch(job("1f1b"), run, 1, True, stop_at=6)
c2 = launch(job("1f1b"), run, 1, True, incarnation=1)
results["colocated_stop_resume"] = {"exit_codes": [c1, c2], **summary(run, "vision+text-0")}
if gpus >= 2:
    for schedule in ("gpipe", "1f1b"):
        run = out / f"split-{schedule}"
        shutil.rmtree(run, ignore_errors=True)
        launch(job(schedule), run, 1, False)
        s = summary(run, "text-0")
        v = summary(run, "vision-0")
        recs = read_jsonl(run / "metrics" / "metrics-text-0.jsonl")
        s["pipeline_s"] = statistics.median(r["pipeline_seconds"] for r in recs[2:])
        s["vision_step_s"] = v["step_s"]
        results[f"split_{schedule}"] = s
    subprocess.run([sys.executable, "bench/elastic_bench.py", "--device", device, "--preset", preset, "--only",
                    "bubble", "--steps", "6", "--micro-batch", "4", "--out", str(out / "bubble")], check=False,
                   timeout=120)
if gpus >= 4:
    run = out / "shrink"
    shutil.rmtree(run, ignore_errors=True)
    c1 = launch(job("1f1b"), run, 2, False, stop_at=6)
    before = summary(run, "text-0")
    c2 = launch(job("1f1b"), run, 1, False, incarnation=1)
    recs = [r for r in read_jsonl(run / "metrics" / "metrics-text-0.jsonl") if r["incarnation"] == 1]
    after = statistics.median(r["global_samples_per_second"] for r in recs[1:])
    results["shrink_2_to_1"] = {"exit_codes": [c1, c2], "before": before["global_samples_per_s"],
                                "after": after, "ratio": after / (0.5 * before["global_samples_per_s"])}
(out / "gpu_results.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
for k, v in results.items():
    print(f"gpu-check: {k}: {json.dumps(v, default=str)}")
EOF
echo "gpu-check: done; figures in $out/gpu_results.json"
