"""ZeRO stages 0-3 against torch's DistributedDataParallel and FSDP2, measured side by side in one run.

    python benchmarks/zero_stages.py                 # 2 ranks, the ~55M-parameter GPT, fp32 AdamW
    python benchmarks/zero_stages.py --quick         # a small GPT, for a smoke check
    python benchmarks/zero_stages.py --reverse-registration 1   # modules registered opposite to their use

Every mode runs in fresh processes (started by torchrun), so each rank's peak RSS is its own. Modes are run
``--rounds`` times in alternating order and the median of the per-round medians is reported, because these
machines are shared and noisy. Reported per mode: median and p90 step time (s), ratio to DDP, peak RSS per
rank (max over ranks, bytes), model-state bytes per rank (from the engine), the realized memory saving
against stage 0 as a fraction of the model-state bytes the stage saves in theory, and bytes sent per rank per
step against the ZeRO paper's 2Ψ(N-1)/N x 4 bytes (stage 3: 3Ψ(N-1)/N x 4; §7). Stage 3 and FSDP2 shard
the same units: each of the GPT's blocks, its embeddings, final norm and LM head (zerorun: ``units = Block``,
the rest units of their own by default), FSDP2 with reshard_after_forward=True.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PREFIX = "BENCH "


def worker(args) -> None:
    import resource

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    sys.path.insert(0, ROOT)
    from zerorun import zero
    from zerorun.userload import build_model

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    stage, _, prefetch_mib = args.worker.partition(":")  # "3:16": stage 3 with zero.prefetch_bytes = 16 MiB
    spec = (os.path.join(ROOT, "recipes/models/gpt.py"), "build_model",
            dict(vocab_size=args.vocab, n_layer=args.layers, n_head=args.heads, d_model=args.d_model,
                 max_seq_len=args.seq, tie_embeddings=not args.untied))
    if stage == "3":  # built on the meta device, each rank materializing its slices only
        model = zero.deferred_init(build_model, *spec)
    else:
        model = build_model(*spec)
    if args.reverse_registration:  # parameters registered opposite to their use in forward (same math)
        for module in [model, *model.blocks]:
            module._modules = dict(reversed(list(module._modules.items())))
    opt_kwargs = {"lr": 1e-4, "betas": (0.9, 0.95)}
    groups = zero.default_param_groups(model, 0.1)
    if args.worker == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        # the same units as zerorun's stage 3 (units = Block; the embeddings, final norm and head are units
        # of their own there by default); the LM head and the embedding are one module when tied
        for block in dict.fromkeys([*model.blocks, model.tok_emb, model.pos_emb, model.ln_f,
                                    *([model.lm_head] if args.untied else [])]):
            fully_shard(block, reshard_after_forward=True)
        fully_shard(model, reshard_after_forward=True)
        opt = torch.optim.AdamW(zero.default_param_groups(model, 0.1), **opt_kwargs)

        def step(batch):
            model(batch)["loss"].backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
        psi = sum(p.numel() for p in model.parameters())  # a DTensor's numel is the global one
        comm = lambda: 0  # noqa: E731
    elif args.worker == "ddp":
        ddp = DDP(model)
        opt = torch.optim.AdamW(groups, **opt_kwargs)

        def step(batch):
            ddp(batch)["loss"].backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=False)
        states = None
        psi = sum(p.numel() for p in model.parameters())
        comm = lambda: 0  # noqa: E731
    else:
        prefetch = {"prefetch_bytes": int(float(prefetch_mib) * 2**20)} if prefetch_mib else {}
        engine = zero.initialize(model, optimizer="AdamW", optimizer_kwargs=opt_kwargs, param_groups=groups,
                                 config=zero.ZeroConfig(stage=int(stage), bucket_mb=args.bucket_mb,
                                                        grad_clip=1.0, units=("Block",), **prefetch))

        def step(batch):
            engine.backward(engine(batch)["loss"])
            engine.step()
        psi = engine.num_params
        comm = lambda: engine.comm_stats()["bytes_sent"]  # noqa: E731
    states = None
    g = torch.Generator().manual_seed(rank)
    times, sent = [], []
    for i in range(args.warmup + args.steps):
        batch = torch.randint(0, args.vocab, (args.micro_batch, args.seq + 1), generator=g)
        dist.barrier()
        b0, t0 = comm(), time.perf_counter()
        step(batch)
        dist.barrier()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
            sent.append(comm() - b0)
    if args.worker not in ("ddp", "fsdp2"):
        states = engine.memory_bytes()
    out = {"mode": args.worker, "rank": rank, "world_size": world, "psi": psi, "times": times,
           "bytes_sent": statistics.median(sent), "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
           "states": states}
    sys.stdout.write(PREFIX + json.dumps(out) + "\n")
    sys.stdout.flush()
    dist.destroy_process_group()


def run_mode(mode: str, args, extra: list[str]) -> list[dict]:
    """Run ``mode`` on ``args.nproc`` ranks of this script (see :func:`run_workers`)."""
    env = {}
    if args.malloc_mmap_threshold:
        env["MALLOC_MMAP_THRESHOLD_"] = str(args.malloc_mmap_threshold)
    if args.thp:
        env["THP_MEM_ALLOC_ENABLE"] = "1"
    return run_workers(os.path.abspath(__file__), mode, args.nproc, extra, env)


def run_workers(script: str, mode: str, nproc: int, extra: list[str], env: dict[str, str]) -> list[dict]:
    """Run ``script --worker MODE EXTRA...`` on ``nproc`` ranks under torchrun (one thread per core share, plus
    ``env``) and return each rank's result dict, the JSON after ``PREFIX`` on its stdout; exits with the ranks'
    output when the job fails or a rank reports nothing."""
    sys.path.insert(0, ROOT)
    from zerorun.launch.plan import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           f"--master-port={free_port()}", "--master-addr=127.0.0.1", script, "--worker", mode, *extra]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // nproc)), **env}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    rows = [json.loads(line[len(PREFIX):]) for line in proc.stdout.splitlines() if line.startswith(PREFIX)]
    if proc.returncode or len(rows) != nproc:
        sys.exit(f"mode {mode} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return rows


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The GPT and run arguments a worker takes (also used by benchmarks/estimate_vs_measured.py)."""
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--untied", type=int, default=1, help="1: separate LM head (the ~55M model), 0: tied")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reverse-registration", type=int, default=0,
                   help="1: the GPT's modules (and each block's) registered in reverse order, as a model whose "
                        "registration order is opposite to its backward's")


def worker_args(args: argparse.Namespace) -> list[str]:
    """The command-line arguments that pass ``args``' model and run settings on to a worker."""
    return [f"--layers={args.layers}", f"--d-model={args.d_model}", f"--heads={args.heads}", f"--vocab={args.vocab}",
            f"--seq={args.seq}", f"--untied={args.untied}", f"--micro-batch={args.micro_batch}",
            f"--bucket-mb={args.bucket_mb}", f"--steps={args.steps}", f"--warmup={args.warmup}",
            f"--reverse-registration={args.reverse_registration}"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--modes", default="ddp,fsdp2,0,1,2,3",
                   help="comma-separated: ddp, fsdp2, 0-3 (zerorun's stages), 3:MIB (stage 3, zero.prefetch_bytes MiB)")
    add_model_args(p)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--malloc-mmap-threshold", type=int, default=1 << 20,
                   help="glibc's MALLOC_MMAP_THRESHOLD_ (bytes) for the ranks of every mode, DDP included, as "
                        "zerorun's launcher sets it; 0 leaves glibc's dynamic threshold")
    p.add_argument("--thp", type=int, default=1, help="1: THP_MEM_ALLOC_ENABLE=1 for every mode, as zerorun's "
                   "launcher sets it (2 MiB pages for large tensors: fewer page faults when memory is re-acquired)")
    p.add_argument("--quick", action="store_true", help="a small GPT (4 layers, d_model 128, vocab 256)")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    if args.quick:
        args.layers, args.d_model, args.heads, args.vocab, args.steps, args.warmup = 4, 128, 4, 256, 8, 2
    if args.worker:
        worker(args)
        return
    extra = worker_args(args)
    modes = args.modes.split(",")
    per_round: dict[str, list[list[dict]]] = {m: [] for m in modes}
    for r in range(args.rounds):
        for mode in (modes if r % 2 == 0 else modes[::-1]):
            per_round[mode].append(run_mode(mode, args, extra))
            print(f"round {r + 1}: {mode} done", file=sys.stderr, flush=True)
    results = {}
    for mode, rounds in per_round.items():
        medians = [statistics.median(t for row in rows for t in row["times"]) for rows in rounds]
        all_times = sorted(t for rows in rounds for row in rows for t in row["times"])
        results[mode] = {
            "step_s": statistics.median(medians),
            "p90_s": all_times[int(0.9 * (len(all_times) - 1))],
            "peak_rss": statistics.median(max(row["peak_rss"] for row in rows) for rows in rounds),
            "states": rounds[0][0]["states"], "psi": rounds[0][0]["psi"],
            "bytes_sent": max(row["bytes_sent"] for row in rounds[0]),
        }
    n = args.nproc
    psi = next(iter(results.values()))["psi"]
    print(f"\n{n} ranks, GPT {args.layers}x{args.d_model}, vocab {args.vocab}, seq {args.seq}, micro-batch "
          f"{args.micro_batch}, Ψ = {psi:,} parameters, fp32 AdamW; {args.rounds} rounds x {args.steps} steps\n")
    print("| mode | median step (s) | p90 (s) | vs DDP | peak RSS/rank (MiB) | model states/rank (MiB) "
          "| realized / theoretical saving vs stage 0 | sent/rank/step (MiB) | vs ZeRO §7 (2Ψ, stage 3: 3Ψ)(N-1)/N·4 |")
    print("|---|---|---|---|---|---|---|---|---|")
    base = results.get("ddp", {}).get("step_s")
    s0 = results.get("0")
    for mode, r in results.items():
        states = sum(r["states"].values()) if r["states"] else None
        ratio = f"{r['step_s'] / base:.3f}x" if base else "-"
        saving = "-"
        if s0 and r["states"] and mode not in ("0", "ddp"):
            theory = sum(s0["states"].values()) - states
            saving = f"{(s0['peak_rss'] - r['peak_rss']) / theory:.2f}" if theory > 0 else "-"
        comm = "-"
        if mode not in ("ddp", "fsdp2"):
            comm = f"{r['bytes_sent'] / ((3 if mode[0] == '3' else 2) * psi * (n - 1) / n * 4):.3f}"
        label = {"ddp": "DDP (torch)", "fsdp2": "FSDP2 (torch fully_shard)"}.get(mode, f"zerorun stage {mode}")
        if ":" in mode:
            label = f"zerorun stage {mode[0]}, prefetch {mode.partition(':')[2]} MiB"
        print(f"| {label} | {r['step_s']:.3f} | "
              f"{r['p90_s']:.3f} | {ratio} | {r['peak_rss'] / 2**20:.0f} | "
              f"{states / 2**20 if states else float('nan'):.0f} | {saving} | "
              f"{r['bytes_sent'] / 2**20:.1f} | {comm} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
