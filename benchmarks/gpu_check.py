"""The device check of issue 33, one command on one GPU (at most 8 minutes on an H200):

    python benchmarks/gpu_check.py                    # CUDA: a ~60M GPT; writes benchmarks/results/gpu_check_cuda.*
    python benchmarks/gpu_check.py --device cpu       # gloo, a tiny GPT, seconds: checks the script itself

Two runs, each one torchrun job (``gpu_check_rank.py`` on every rank), every case in one process group:

1. world size 1 on NCCL (CPU: gloo): ZeRO stages 0-3 in fp32 and bf16, DDP and FSDP2 (``fully_shard``) in
   fp32 (zerorun's baselines, ``zerorun/bench/baselines.py``), and stages 2 and 3 with ZeRO++'s int8 gradients
   (and weights at stage 3; their parity is within the quantization's, not fp32's; on 2 ranks they quantize).
2. world size 2 sharing the one GPU: NCCL first; NCCL refuses two ranks on one device ("Duplicate GPU
   detected"), so when that run fails it is run again on gloo with CUDA tensors (gloo stages them through the
   host) and the summary says which ran and why. The 2-rank run uses a smaller GPT (``--small``).

Per case: parity with DDP over ``--parity-steps`` steps (largest relative difference of loss and grad norm per
step, and of the final parameters; bf16 against DDP of the bf16 model with fp32 masters), then a fresh model:
peak memory (``torch.cuda.max_memory_allocated``) against the ZeRO paper's model states (16Ψ/N at stage 3;
per stage ``paper_bytes`` in gpu_check_rank.py) and ``zerorun estimate``'s prediction for the same model,
stage and world size (its model states, working set, activations and device total); samples/s; host syncs
(``torch.cuda.set_sync_debug_mode("warn")``, its warnings counted with the line that made each) in one
steady micro-step (forward + backward) and one optimizer step; the fraction of communication time hidden
behind compute from a ``torch.profiler`` trace (NCCL kernels against the other kernels on the GPU's
timeline; with gloo, its collectives' spans on the host). Once per run: the agreements' gloo group beside the
job's, and that a parameter written in place between steps is kept with the masters on the device and in host
memory (Note [Writes between steps]). Writes ``<out>.json`` (every figure, per rank) and
``<out>.md`` (rank 0's table and the command) and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RANK_SCRIPT = os.path.join(HERE, "gpu_check_rank.py")
MODEL_ARGS = ("layers", "d_model", "heads", "vocab", "seq", "micro_batch", "steps", "warmup", "parity_steps",
              "profile_steps", "bucket_mb", "lr", "clip", "precisions", "runtimes")


def run(args, world_size: int, backend: str, budget_s: float, small: bool) -> tuple[list[dict], str | None]:
    """One torchrun job of ``world_size`` ranks on ``backend``: the rows every rank printed, or the failure's
    last lines."""
    sys.path.insert(0, ROOT)
    from zerorun.launch.plan import free_port

    values = dict(vars(args))
    if small:
        values.update(layers=max(1, args.layers // 3), d_model=max(32, args.d_model // 2),
                      heads=max(1, args.heads // 2))
    extra = [f"--{k.replace('_', '-')}={values[k]}" for k in MODEL_ARGS]
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world_size}",
           f"--master-port={free_port()}", "--master-addr=127.0.0.1", RANK_SCRIPT, f"--device={args.device}",
           f"--backend={backend}", f"--budget-s={max(1.0, budget_s - 30)}", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // world_size)),
           "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=max(10.0, budget_s))
    except subprocess.TimeoutExpired as e:
        return [], f"timed out after {budget_s:.0f} s: {(e.stdout or b'')[-400:]!r}"
    rows = [json.loads(line[len("GPUCHECK "):]) for line in proc.stdout.splitlines() if line.startswith("GPUCHECK ")]
    if proc.returncode:
        tail = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()][-6:]
        return rows, f"exit {proc.returncode}: " + " | ".join(tail)[-1500:]
    return rows, None


def nccl_version() -> str:
    import torch

    v = torch.cuda.nccl.version()  # a tuple in recent torch, an int (major * 1000 + minor * 100 + patch) before
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def fmt_mib(n) -> str:
    return "-" if n is None else f"{n / 2**20:.0f}"


def table(run_: dict) -> list[str]:
    """Markdown rows of rank 0's cases of one run."""
    control = next((r.get("control") for r in run_["rows"] if r.get("rank") == 0), None)
    writes = next((r.get("writes") for r in run_["rows"] if r.get("rank") == 0), None)
    lines = [f"\n### world size {run_['world_size']}, {run_['backend']}" +
             (f" (NCCL refused: {run_['fallback_reason'][:200]})" if run_.get("fallback_reason") else ""),
             "", f"Agreements' group (Note [Agreements on the host]): {control}", "",
             f"Writes between steps (Note [Writes between steps]): {writes}", "",
             "| precision | runtime | parity loss / norm / params (rel) | peak (MiB) | paper states (MiB) "
             "| estimate states / total (MiB) | samples/s | syncs micro / step | comm hidden |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in run_["rows"]:
        if r.get("rank") != 0:
            continue
        if "error" in r or "skipped" in r:
            lines.append(f"| {r['precision']} | {r['runtime']} | {r.get('error') or r.get('skipped')} "
                         "| | | | | | |")
            continue
        par = r.get("parity")
        par_s = "-" if not par else f"{par['loss']:.1e} / {par['grad_norm']:.1e} / {par['params']:.1e}"
        est = r.get("estimate")
        est_s = "-" if not est else f"{fmt_mib(est['model_states'])} / {fmt_mib(est['device_total'])}"
        frac = r["overlap"]["fraction"]
        lines.append(f"| {r['precision']} | {r['runtime']} | {par_s} | {fmt_mib(r['peak_bytes'])} "
                     f"| {fmt_mib(r.get('paper_bytes'))} | {est_s} | {r['samples_per_s']:.1f} "
                     f"| {r['syncs_per_micro_step']} / {r['syncs_per_optimizer_step']} "
                     f"| {'-' if frac is None else f'{frac:.0%}'} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--out", help="path prefix of the .json and .md (default benchmarks/results/gpu_check_<device>)")
    p.add_argument("--budget-s", type=float, default=450.0,
                   help="seconds for the whole check (each run gets its share)")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--parity-steps", type=int, default=4)
    p.add_argument("--profile-steps", type=int, default=2)
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--precisions", default="fp32,bf16")
    p.add_argument("--runtimes", default="stage0,stage1,stage2,stage3,ddp,fsdp2,stage2-qgz,stage3-qwz-qgz",
                   help="stageN, ddp, fsdp2; stageN-qgz / stage3-qwz-qgz: with ZeRO++'s int8 gradients / weights")
    p.add_argument("--world-sizes", default="1,2", help="the runs: 1 (one rank), 2 (two ranks on the one GPU)")
    args = p.parse_args(argv)
    if args.device == "cpu" and "--layers" not in (argv if argv is not None else sys.argv):
        args.layers, args.d_model, args.heads, args.vocab, args.seq, args.micro_batch = 2, 32, 2, 128, 16, 2
        args.steps, args.warmup, args.parity_steps, args.profile_steps, args.bucket_mb = 2, 1, 2, 1, 0.01
    out = args.out or os.path.join(HERE, "results", f"gpu_check_{args.device}")
    t0 = time.time()
    runs = []
    first = "nccl" if args.device == "cuda" else "gloo"
    sizes = [int(n) for n in args.world_sizes.split(",")]
    if 1 in sizes:
        share = 0.55 if 2 in sizes else 1.0
        rows, error = run(args, 1, first, args.budget_s * share, small=False)
        runs.append({"world_size": 1, "backend": first, "rows": rows, "error": error})
    if 2 in sizes:
        rows, error = run(args, 2, first, args.budget_s - (time.time() - t0), small=True)
        fallback = None
        if error and first == "nccl":  # the docstring's run 2: NCCL refuses two ranks on one GPU
            fallback = error
            rows, error = run(args, 2, "gloo", args.budget_s - (time.time() - t0), small=True)
        runs.append({"world_size": 2, "backend": "gloo" if fallback else first, "rows": rows, "error": error,
                     "fallback_reason": fallback})
    command = "python benchmarks/gpu_check.py " + " ".join(argv if argv is not None else sys.argv[1:])
    import torch

    cuda = args.device == "cuda"
    summary = {"command": command.strip(), "device": torch.cuda.get_device_name(0) if cuda else "cpu",
               "torch": torch.__version__, "nccl": nccl_version() if cuda else None,
               "elapsed_s": round(time.time() - t0, 1), "args": vars(args), "runs": runs}
    lines = [f"# gpu_check: {summary['device']}, torch {summary['torch']}", "", f"`{summary['command']}` "
             f"({summary['elapsed_s']} s). Parity: largest relative difference to DDP; peak: max_memory_allocated; "
             "paper states: ZeRO's model states per rank; syncs: set_sync_debug_mode warnings per steady "
             "micro-step / optimizer step; comm hidden: share of communication time overlapped by compute."]
    for r in runs:
        lines += table(r) + ([f"\nrun error: {r['error']}"] if r["error"] else [])
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out + ".json", "w") as f:
        json.dump(summary, f, indent=1)
    with open(out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if runs and all(r["rows"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
