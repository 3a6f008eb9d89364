"""Elastic shrink throughput and pipeline bubble of the training runtime, measured side by side.

1. Shrink: train with k replicas (2k ranks: k vision + k text), stop with SIGUSR1 (checkpoint,
   exit 75), resume the same job with k-1 replicas. Global throughput = global batch / median step
   time (first steps of each phase skipped). Printed: after / ((k-1)/k x before); the bar is >= 0.9.
2. Bubble: one replica (one vision rank, one text rank), GPipe and 1F1B. The time in the pipeline
   schedule per step over the slower stage's own compute time for the same micro-batches (forward +
   backward of that stage alone, measured in this process with the same thread count). 1.0 would
   be no bubble; the ideal without communication is 1 + (faster stage / M) / slower stage, which is
   (M + 1) / M for two equal stages.

Usage (CPU, a few minutes on 2 cores):  .venv/bin/python bench/elastic_bench.py
      (fair shrink on 2 cores: 2 -> 1 ranks that hold both stages)  ... --only shrink --colocated
      (GPU, one GPU per rank):           .venv/bin/python bench/elastic_bench.py --device cuda --preset base
On a shared machine, run nothing else meanwhile: ranks compete for cores, so "before" (2k ranks) and
"after" (2k-2 ranks) do not see the same per-rank CPU; the printed figures say what they measured.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import statistics
import sys
import time
from pathlib import Path

import torch

from slurm_omni.config.training import ModelConfig
from slurm_omni.elastic.metrics import read_jsonl
from slurm_omni.runtime.launch import launch_local
from slurm_omni.runtime.model import TextMicroBatch, TextStage, VisionStage, lm_loss, next_token_labels
from slurm_omni.runtime.synth import SynthSpec, write_shards

JOB = """\
[training]
max_steps = {max_steps}
[training.model]
preset = "{preset}"
[training.parallel]
schedule = "{schedule}"
global_batch_size = {global_batch}
micro_batch_size = {micro_batch}
[training.optim]
warmup_steps = 2
[training.data]
shard_dir = "{shards}"
[[training.data.sources]]
name = "pairs"
weight = 3
[[training.data.sources]]
name = "text"
weight = 1
[training.checkpoint]
every_steps = 0
"""


def write_job(out: Path, name: str, args: argparse.Namespace, *, max_steps: int, schedule: str,
              global_batch: int) -> Path:
    path = out / f"{name}.toml"
    path.write_text(JOB.format(max_steps=max_steps, preset=args.preset, schedule=schedule,
                               global_batch=global_batch, micro_batch=args.micro_batch, shards=out / "shards"))
    return path


def step_stats(run_dir: Path, stage_file: str, first_step: int, skip: int) -> tuple[float, float]:
    """Median step time and median pipeline time of steps > first_step + skip."""
    recs = [r for r in read_jsonl(run_dir / "metrics" / f"metrics-{stage_file}.jsonl")
            if int(r["step"]) > first_step + skip]  # type: ignore[call-overload]
    if not recs:
        raise SystemExit(f"bench: no metrics in {run_dir} after step {first_step + skip}")
    return (statistics.median(float(r["step_time_seconds"]) for r in recs),  # type: ignore[arg-type]
            statistics.median(float(r["pipeline_seconds"]) for r in recs))  # type: ignore[arg-type]


def run_ranks(job: Path, run_dir: Path, dp: int, args: argparse.Namespace, *, incarnation: int = 0,
              stop_after_step: int | None = None, colocated: bool = False) -> list[int]:
    env = {"OMNI_DEVICE": args.device}
    handle = launch_local(job, data_parallel_size=dp, run_dir=run_dir, incarnation=incarnation, extra_env=env,
                          threads_per_rank=args.threads, colocated=colocated)
    if stop_after_step is not None:
        hb = run_dir / "heartbeat" / "rank-0.json"
        while True:
            rec = read_jsonl(hb)
            if rec and rec[0]["incarnation"] == incarnation and int(rec[0]["step"]) >= stop_after_step:  # type: ignore[call-overload]
                break
            if any(p.poll() is not None for p in handle.procs):
                break
            time.sleep(0.05)
        handle.send(signal.SIGUSR1)
    codes = handle.wait(args.timeout)
    if any(c not in (0, 75) for c in codes):
        print(handle.logs(), file=sys.stderr)
        raise SystemExit(f"bench: ranks exited with {codes}")
    return codes


def shrink(args: argparse.Namespace, out: Path) -> dict[str, float]:
    k = args.k
    global_batch = args.micro_batch * k * (k - 1) * args.micro_batches
    job = write_job(out, "shrink", args, max_steps=10 ** 6, schedule="1f1b", global_batch=global_batch)
    run_dir = out / ("shrink-colocated" if args.colocated else "shrink")
    name = "vision+text-0" if args.colocated else "text-0"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_ranks(job, run_dir, k, args, stop_after_step=args.steps, colocated=args.colocated)
    before_step, _ = step_stats(run_dir, name, 0, args.skip)
    stopped = max(int(r["step"]) for r in read_jsonl(run_dir / "metrics" / f"metrics-{name}.jsonl"))  # type: ignore[call-overload]
    run_ranks(job, run_dir, k - 1, args, incarnation=1, stop_after_step=stopped + args.steps,
              colocated=args.colocated)
    recs = [r for r in read_jsonl(run_dir / "metrics" / f"metrics-{name}.jsonl") if r["incarnation"] == 1]
    after_step = statistics.median(float(r["step_time_seconds"]) for r in recs[args.skip:])  # type: ignore[arg-type]
    before, after = global_batch / before_step, global_batch / after_step
    # The same with each rank's own CPU time in the schedule instead of wall time: what the ratio is
    # when every rank has its own core (or GPU), whatever else the machine runs.
    first = [r for r in read_jsonl(run_dir / "metrics" / f"metrics-{name}.jsonl") if r["incarnation"] == 0]
    cpu_before = statistics.median(float(r["pipeline_cpu_seconds"]) for r in first[args.skip:])  # type: ignore[arg-type]
    cpu_after = statistics.median(float(r["pipeline_cpu_seconds"]) for r in recs[args.skip:])  # type: ignore[arg-type]
    return {"k": k, "colocated": args.colocated, "global_batch": global_batch, "samples_per_s_before": before,
            "samples_per_s_after": after, "shrink_ratio": after / ((k - 1) / k * before),
            "cpu_s_before": cpu_before, "cpu_s_after": cpu_after,
            "shrink_ratio_own_compute": (global_batch / cpu_after) / ((k - 1) / k * global_batch / cpu_before)}


def stage_compute_s(model: ModelConfig, micro_batches: int, micro_batch: int, device: str,
                    repeats: int = 5) -> tuple[float, float]:
    """Forward + backward time of each stage alone over ``micro_batches`` micro-batches (median)."""
    dev = torch.device(device)
    vision, text = VisionStage(model).to(dev), TextStage(model).to(dev)
    b = micro_batch
    images = torch.rand(b, model.image_size, model.image_size, model.channels, device=dev)
    ids = torch.arange(b, device=dev)
    tokens = torch.randint(1, model.vocab_size, (b, model.seq_len), device=dev)
    labels = next_token_labels(tokens)
    has_image = torch.ones(b, dtype=torch.bool, device=dev)
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats + 1):
        for stage in (0, 1):
            sync(device)
            t0 = time.monotonic()
            for _m in range(micro_batches):
                if stage == 0:
                    out, _ = vision(images, ids)
                    out.backward(torch.ones_like(out))
                else:
                    emb = torch.randn(b, model.num_patches, model.text_width, device=dev, requires_grad=True)
                    text.feed.append(TextMicroBatch(ids, tokens, has_image))
                    lm_loss(text(emb, ids), labels).backward()
            sync(device)
            times[stage].append(time.monotonic() - t0)
    return statistics.median(times[0][1:]), statistics.median(times[1][1:])


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def median_of(run_dir: Path, stage_file: str, key: str, skip: int) -> float:
    recs = read_jsonl(run_dir / "metrics" / f"metrics-{stage_file}.jsonl")[skip:]
    return statistics.median(float(r[key]) for r in recs)  # type: ignore[arg-type]


def bubble(args: argparse.Namespace, out: Path) -> dict[str, float]:
    """On CPU a stage's own compute is its rank's CPU time inside the schedule (same run, immune to
    waiting); on CUDA it is measured in this process with synchronised timers."""
    torch.set_num_threads(args.threads)
    model = ModelConfig(preset=args.preset)
    m = args.micro_batches
    result: dict[str, float] = {"micro_batches": m}
    if args.device == "cuda":
        result["vision_compute_s"], result["text_compute_s"] = stage_compute_s(model, m, args.micro_batch, "cuda")
    for schedule in ("gpipe", "1f1b"):
        job = write_job(out, f"bubble-{schedule}", args, max_steps=args.steps + args.skip, schedule=schedule,
                        global_batch=m * args.micro_batch)
        run_dir = out / f"bubble-{schedule}"
        shutil.rmtree(run_dir, ignore_errors=True)
        run_ranks(job, run_dir, 1, args)
        pipe_s = median_of(run_dir, "text-0", "pipeline_seconds", args.skip)
        if args.device == "cuda":
            vision, text = result["vision_compute_s"], result["text_compute_s"]
        else:
            vision = median_of(run_dir, "vision-0", "pipeline_cpu_seconds", args.skip)
            text = median_of(run_dir, "text-0", "pipeline_cpu_seconds", args.skip)
            result[f"{schedule}_vision_cpu_s"], result[f"{schedule}_text_cpu_s"] = vision, text
        own = max(vision, text)
        result[f"{schedule}_pipeline_s"] = pipe_s
        result[f"{schedule}_step_s"] = median_of(run_dir, "text-0", "step_time_seconds", args.skip)
        result[f"{schedule}_bubble"] = pipe_s / own
        # Without communication cost: the slower stage's compute plus one micro-batch of the other.
        result[f"{schedule}_ideal"] = 1 + min(vision, text) / (m * own)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small", choices=["tiny", "small", "base", "large"])
    ap.add_argument("--k", type=int, default=2, help="replicas before the shrink (k-1 after)")
    ap.add_argument("--steps", type=int, default=8, help="measured steps per phase")
    ap.add_argument("--skip", type=int, default=2, help="warm-up steps left out of each phase")
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--micro-batches", type=int, default=4, help="per replica (bubble), per k-1 share (shrink)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--out", type=Path, default=Path("bench/out/elastic"))
    ap.add_argument("--only", choices=["shrink", "bubble"], default=None)
    ap.add_argument("--colocated", action="store_true",
                    help="shrink with ranks that hold both stages (k ranks -> k-1): on a machine with k free "
                         "cores, before and after get one core per rank, so the ratio is fair there")
    args = ap.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    model = ModelConfig(preset=args.preset)
    write_shards(SynthSpec(out_dir=out / "shards", pairs=192, text=64, shard_size=64, image_size=model.image_size,
                           channels=model.channels, seq_len=model.seq_len, vocab_size=model.vocab_size))
    results: dict[str, object] = {"preset": args.preset, "device": args.device, "threads_per_rank": args.threads}
    if args.only in (None, "bubble"):
        results["bubble"] = b = bubble(args, out)
        own = {k: round(v, 4) for k, v in b.items() if k.endswith(("compute_s", "cpu_s"))}
        print(f"bubble ({args.preset}, M={b['micro_batches']}): stage compute {own}; "
              f"GPipe {b['gpipe_pipeline_s']:.3f}s -> {b['gpipe_bubble']:.2f}x, "
              f"1F1B {b['1f1b_pipeline_s']:.3f}s -> {b['1f1b_bubble']:.2f}x (ideal without communication: "
              f"{b['gpipe_ideal']:.2f}x / {b['1f1b_ideal']:.2f}x)")
    if args.only in (None, "shrink"):
        results["shrink"] = s = shrink(args, out)
        layout = "colocated ranks" if args.colocated else "replicas of 2 ranks"
        print(f"shrink {s['k']}->{s['k'] - 1} {layout} (global batch {s['global_batch']}): "
              f"{s['samples_per_s_before']:.1f} -> {s['samples_per_s_after']:.1f} samples/s; "
              f"after / ((k-1)/k x before) = {s['shrink_ratio']:.2f} (bar 0.9); on own compute time per rank "
              f"({s['cpu_s_before']:.3f}s -> {s['cpu_s_after']:.3f}s per step): {s['shrink_ratio_own_compute']:.2f}")
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    print(f"results in {out / 'results.json'}")


if __name__ == "__main__":
    main()
