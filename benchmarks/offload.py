"""Optimizer offload (``zero.offload_optimizer``): peak RSS and step time per rank, none vs cpu vs disk.

    python benchmarks/offload.py                      # 2 ranks, stage 2, the ~195M-parameter GPT, fp32 AdamW
    python benchmarks/offload.py --quick              # a small GPT, for a smoke check

Each mode runs in fresh processes (torchrun), so each rank's peak RSS is its own. Reported per mode: median
step time (s) and its ratio to no offload; peak RSS per rank over the whole run (``ru_maxrss``) and over the
training steps only (``VmHWM`` after resetting it through ``/proc/self/clear_refs`` once the engine is built,
so model construction does not mask the steps); optimizer bytes per rank the engine holds in memory; and the
training peak saved against ``none`` as a fraction of ``none``'s optimizer-state bytes per rank (the goal for
``disk``: >= 0.8). The ranks get ``MALLOC_MMAP_THRESHOLD_`` as zerorun's launcher sets it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PREFIX = "BENCH "


def _hwm_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def worker(args) -> None:
    import resource

    import torch
    import torch.distributed as dist

    sys.path.insert(0, ROOT)
    from zerorun import zero
    from zerorun.rank.userload import build_model

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = build_model(os.path.join(ROOT, "recipes/models/gpt.py"), "build_model",
                        dict(vocab_size=args.vocab, n_layer=args.layers, n_head=args.heads, d_model=args.d_model,
                             max_seq_len=args.seq, tie_embeddings=False))
    engine = zero.initialize(model, optimizer="AdamW", optimizer_kwargs={"lr": 1e-4, "betas": (0.9, 0.95)},
                             param_groups=zero.default_param_groups(model, 0.1),
                             config=zero.ZeroConfig(stage=2, grad_clip=1.0, precision=args.precision,
                                                    offload_optimizer=args.worker, offload_path=args.offload_path,
                                                    offload_buffer_mb=args.buffer_mb))
    with open("/proc/self/clear_refs", "w") as f:  # reset VmHWM: the training peak from here on
        f.write("5")
    g = torch.Generator().manual_seed(rank)
    times = []
    for i in range(args.warmup + args.steps):
        batch = torch.randint(0, args.vocab, (args.micro_batch, args.seq + 1), generator=g)
        dist.barrier()
        t0 = time.perf_counter()
        engine.backward(engine(batch)["loss"])
        engine.step()
        dist.barrier()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    out = {"mode": args.worker, "rank": rank, "psi": engine.num_params, "times": times,
           "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "train_peak_rss": _hwm_bytes(),
           "states": engine.memory_bytes(), "offload": engine.offload_bytes()}
    engine.close()
    sys.stdout.write(PREFIX + json.dumps(out) + "\n")
    sys.stdout.flush()
    dist.destroy_process_group()


def run_mode(mode: str, args, extra: list[str]) -> list[dict]:
    """Run offload ``mode`` on ``args.nproc`` ranks of this script (zero_stages.run_workers)."""
    from zero_stages import run_workers

    return run_workers(os.path.abspath(__file__), mode, args.nproc, extra,
                       {"MALLOC_MMAP_THRESHOLD_": str(1 << 20)})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--modes", default="none,cpu,disk")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--precision", default="fp32", help="fp32 | bf16 | fp16 (bf16 matmuls are ~50x slower than "
                   "fp32 on CPUs without AVX512-BF16)")
    p.add_argument("--buffer-mb", type=float, default=64.0, help="zero.offload_buffer_mb for disk")
    p.add_argument("--offload-path", default=None, help="folder for disk's swap files (default: a temp dir)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="a small GPT (4 layers, d_model 128, vocab 256)")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    if args.quick:
        args.layers, args.d_model, args.heads, args.vocab = 4, 128, 4, 256
    if args.worker:
        worker(args)
        return
    tmp = None
    if args.offload_path is None:
        tmp = args.offload_path = tempfile.mkdtemp(prefix="zerorun-offload-bench-")
    extra = [f"--layers={args.layers}", f"--d-model={args.d_model}", f"--heads={args.heads}", f"--vocab={args.vocab}",
             f"--seq={args.seq}", f"--micro-batch={args.micro_batch}", f"--precision={args.precision}",
             f"--buffer-mb={args.buffer_mb}", f"--offload-path={args.offload_path}", f"--steps={args.steps}",
             f"--warmup={args.warmup}"]
    results = {}
    try:
        for mode in args.modes.split(","):
            rows = run_mode(mode, args, extra)
            print(f"{mode} done", file=sys.stderr, flush=True)
            results[mode] = {"step_s": statistics.median(t for r in rows for t in r["times"]),
                             "peak_rss": max(r["peak_rss"] for r in rows),
                             "train_peak_rss": max(r["train_peak_rss"] for r in rows),
                             "states": rows[0]["states"], "offload": rows[0]["offload"], "psi": rows[0]["psi"]}
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    psi = next(iter(results.values()))["psi"]
    print(f"\n{args.nproc} ranks, ZeRO stage 2, {args.precision} AdamW, GPT {args.layers}x{args.d_model}, vocab "
          f"{args.vocab}, seq {args.seq}, micro-batch {args.micro_batch}, Ψ = {psi:,}; {args.steps} steps after "
          f"{args.warmup} warm-up; disk buffer {args.buffer_mb} MiB\n")
    print("| offload | median step (s) | vs none | peak RSS/rank, whole run (MiB) | peak RSS/rank, training (MiB) "
          "| optimizer bytes/rank in memory (MiB) | training peak saved / none's optimizer bytes |")
    print("|---|---|---|---|---|---|---|")
    base = results.get("none")
    for mode, r in results.items():
        ratio = f"{r['step_s'] / base['step_s']:.2f}x" if base else "-"
        saved = "-"
        if base and mode != "none":
            saved = f"{(base['train_peak_rss'] - r['train_peak_rss']) / base['states']['optimizer']:.2f}"
        print(f"| {mode} | {r['step_s']:.2f} | {ratio} | {r['peak_rss'] / 2**20:.0f} | "
              f"{r['train_peak_rss'] / 2**20:.0f} | {r['states']['optimizer'] / 2**20:.0f} | {saved} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
