"""ZeRO stages 0-3 against torch's DistributedDataParallel and FSDP2, measured side by side in one run.

    python benchmarks/zero_stages.py                 # 2 ranks, the ~55M-parameter GPT, fp32 AdamW
    python benchmarks/zero_stages.py --quick         # a small GPT, for a smoke check
    python benchmarks/zero_stages.py --reverse-registration 1   # modules registered opposite to their use
    python benchmarks/zero_stages.py --modes ddp,1,2 --envs alloc,default   # zerorun's rank env vs torchrun's

Environments (``--envs``, interleaved with the modes; benchmarks/rank_envs.py lists and explains them): ``default``
as torchrun runs DDP and FSDP2, ``alloc`` glibc tuned, ``tcmalloc`` and ``mimalloc`` as zerorun's launcher gives
them to ranks (Note [Rank allocator] in zerorun/allocator.py), and variants of each. Without ``--envs`` every
mode, DDP included, gets ``--malloc-mmap-threshold`` and ``--thp`` (by default glibc tuned). Besides step time,
each rank's CPU seconds (user + kernel, all threads) and minor page faults per step are reported: steadier than
wall-clock time on a shared machine.

Every mode runs in fresh processes (started by torchrun), so each rank's peak RSS is its own. Modes are run
``--rounds`` times in alternating order and the median of the per-round medians is reported, because these
machines are shared and noisy. Reported per mode: median and p90 step time (s), ratio to DDP, peak RSS per
rank (max over ranks, bytes), model-state bytes per rank (from the engine), the realized memory saving
against stage 0 as a fraction of the model-state bytes the stage saves in theory, and bytes sent per rank per
step against the ZeRO paper's 2Ψ(N-1)/N x 4 bytes (stage 3: 3Ψ(N-1)/N x 4; §7). Stage 3 and FSDP2 shard
the GPT's blocks and embeddings (units = Block, Embedding), FSDP2 with reshard_after_forward=True.

DeepSpeed (``--modes ds2,ds3,ds2b,ds3b``, where ``import deepspeed`` works: docs/benchmarks.md, "DeepSpeed
beside them": its virtual environment) runs as its users run it: ``deepspeed.initialize`` with torch's AdamW as the
client optimizer over the same param
groups, ``gradient_clipping: 1.0``, fp32, its own defaults for everything else (ZeRO-3: its prefetch and
persistence thresholds; ``ds2b``/``ds3b``: its reduce, all-gather and prefetch buckets of ``--bucket-mb``
like zerorun's), ``DS_ACCELERATOR=cpu``; the model is built whole on every rank and partitioned by
``initialize`` (under ``deepspeed.zero.Init`` the GPT's own weight init, applied after construction, would see
empty partitions and train other numbers). Each mode's loss at
the last step is printed: the same numbers to 5 decimals where the runtimes agree.
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
sys.path.insert(0, ROOT)
from rank_envs import ENVS  # noqa: E402 - benchmarks/rank_envs.py, torch-free


def worker(args) -> None:
    import resource

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    sys.path.insert(0, ROOT)
    from zerorun import zero
    from zerorun.rank.userload import build_model

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    ds_config = None
    if args.worker in DEEPSPEED_MODES:  # as DeepSpeed's users run it: its defaults, fp32, the same clipping
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
        ds_config = {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": 1,
                     "gradient_clipping": 1.0, "zero_optimization": {"stage": DEEPSPEED_MODES[args.worker]}}
        if args.worker.endswith("b"):  # buckets (fp32 elements) of zerorun's size
            elements = int(args.bucket_mb * 2**20 / 4)
            ds_config["zero_optimization"].update({"reduce_bucket_size": elements, "allgather_bucket_size": elements,
                                                   "stage3_prefetch_bucket_size": elements})
    else:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    spec = (os.path.join(ROOT, "recipes/models/gpt.py"), "build_model",
            dict(vocab_size=args.vocab, n_layer=args.layers, n_head=args.heads, d_model=args.d_model,
                 max_seq_len=args.seq, tie_embeddings=not args.untied))
    if args.worker == "3":  # built on the meta device, each rank materializing its slices only
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

        for block in [*model.blocks, model.tok_emb, model.pos_emb]:  # the same units as zerorun's stage 3
            fully_shard(block, reshard_after_forward=True)
        fully_shard(model, reshard_after_forward=True)
        opt = torch.optim.AdamW(zero.default_param_groups(model, 0.1), **opt_kwargs)

        def step(batch):
            loss = model(batch)["loss"]
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            return loss
        psi = sum(p.numel() for p in model.parameters())  # a DTensor's numel is the global one
        comm = lambda: 0  # noqa: E731
    elif args.worker in DEEPSPEED_MODES:
        eng, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(groups, **opt_kwargs),
                                            config=ds_config, dist_init_required=False)

        def step(batch):
            loss = eng(batch)["loss"]
            eng.backward(loss)
            eng.step()
            return loss
        psi = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
        comm = lambda: 0  # noqa: E731
    elif args.worker == "ddp":
        ddp = DDP(model)
        opt = torch.optim.AdamW(groups, **opt_kwargs)

        def step(batch):
            loss = ddp(batch)["loss"]
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=False)
            return loss
        states = None
        psi = sum(p.numel() for p in model.parameters())
        comm = lambda: 0  # noqa: E731
    else:
        engine = zero.initialize(model, optimizer="AdamW", optimizer_kwargs=opt_kwargs, param_groups=groups,
                                 config=zero.ZeroConfig(stage=int(args.worker), bucket_mb=args.bucket_mb,
                                                        grad_clip=1.0, units=tuple(args.units.split(",")),
                                                        prefetch_bytes=None if args.prefetch_bytes < 0
                                                        else args.prefetch_bytes))

        def step(batch):
            loss = engine(batch)["loss"]
            engine.backward(loss)
            engine.step()
            return loss
        psi = engine.num_params
        comm = lambda: engine.comm_stats()["bytes_sent"]  # noqa: E731
    states = None
    from zerorun.zero import allocator
    policy = ENVS.get(args.env, ({}, None))[1]
    g = torch.Generator().manual_seed(rank)
    times, sent, end_rss, cpu, sys_s, faults = [], [], [], [], [], []
    for i in range(args.warmup + args.steps):
        batch = torch.randint(0, args.vocab, (args.micro_batch, args.seq + 1), generator=g)
        dist.barrier()
        b0, t0, u0 = comm(), time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
        loss = float(step(batch).detach())
        if policy == "trim":
            allocator.trim()
        elif policy == "collect":  # Note [Rank allocator]: once per step, after the optimizer step
            allocator.collect()
        dist.barrier()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
            sent.append(comm() - b0)
            end_rss.append(allocator.rss_bytes())
            u1 = resource.getrusage(resource.RUSAGE_SELF)  # CPU seconds and page faults of the step, all threads
            cpu.append(u1.ru_utime - u0.ru_utime + u1.ru_stime - u0.ru_stime)
            sys_s.append(u1.ru_stime - u0.ru_stime)
            faults.append(u1.ru_minflt - u0.ru_minflt)
    if args.worker.isdigit():
        states = engine.memory_bytes()
    out = {"mode": args.worker, "rank": rank, "world_size": world, "psi": psi, "times": times,
           "bytes_sent": statistics.median(sent), "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss *
           1024,
           "end_rss": statistics.median(end_rss), "cpu_s": statistics.median(cpu),
           "sys_s": statistics.median(sys_s), "faults": statistics.median(faults),
           "states": states, "loss": loss}
    sys.stdout.write(PREFIX + json.dumps(out) + "\n")
    sys.stdout.flush()
    dist.destroy_process_group()


#: DeepSpeed's ZeRO (when installed): mode -> its ``zero_optimization.stage``; ``b``: its buckets of
#: ``--bucket-mb`` (zerorun's) instead of its defaults
DEEPSPEED_MODES = {"ds2": 2, "ds3": 3, "ds2b": 2, "ds3b": 3}

def run_mode(mode: str, args, extra: list[str], env_name: str | None = None) -> list[dict]:
    """Run ``mode`` on ``args.nproc`` ranks of this script in environment ``env_name`` (a key of
    :data:`ENVS`; None: ``args.malloc_mmap_threshold``/``args.thp``) (see :func:`run_workers`)."""
    env = {}
    if env_name is not None:
        env = dict(ENVS[env_name][0])
    else:
        env_name = "flags"  # --malloc-mmap-threshold and --thp
        if args.malloc_mmap_threshold:
            env["MALLOC_MMAP_THRESHOLD_"] = str(args.malloc_mmap_threshold)
        if args.thp:
            env["THP_MEM_ALLOC_ENABLE"] = "1"
    return run_workers(os.path.abspath(__file__), mode, args.nproc, [*extra, f"--env={env_name}"], env)


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
    p.add_argument("--units", default="Block,Embedding",
                   help="zerorun stage 3's zero.units (FSDP2 always shards the blocks and the embeddings); "
                        "'Block' leaves the embeddings and the head to outer units (Note [Outer units])")
    p.add_argument("--prefetch-bytes", type=int, default=-1,
                   help="zerorun stage 3's zero.prefetch_bytes (-1: unset, the next unit; 0: no prefetch)")
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
            f"--units={args.units}",
            f"--reverse-registration={args.reverse_registration}", f"--prefetch-bytes={args.prefetch_bytes}"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--modes", default="ddp,fsdp2,0,1,2,3")
    p.add_argument("--env", default="default", help=argparse.SUPPRESS)
    p.add_argument("--envs", default=None, help="comma-separated environments each mode runs in, "
                   "interleaved (" + ", ".join(ENVS) + ")")
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
    envs = args.envs.split(",") if args.envs else [None]
    # a mode may name its one environment (ddp@default: DDP as torchrun runs it); the others run in every --envs
    modes = [tuple(m.split("@", 1)) if "@" in m else (m, e) for m in dict.fromkeys(args.modes.split(","))
             for e in ([None] if "@" in m else envs)]
    modes = list(dict.fromkeys(modes))
    unknown = [m for m, _ in modes if m not in ("ddp", "fsdp2", "0", "1", "2", "3", *DEEPSPEED_MODES)]
    if unknown:
        sys.exit(f"--modes: unknown mode {unknown[0]!r} (ddp, fsdp2, 0-3, {', '.join(DEEPSPEED_MODES)})")
    if any(m in DEEPSPEED_MODES for m, _ in modes):
        try:
            import deepspeed  # noqa: F401
        except ImportError:
            sys.exit("--modes ds2, ds3, ds2b, ds3b need DeepSpeed in this Python (docs/benchmarks.md, "
                     "\"DeepSpeed beside them\": a virtual environment with it)")
    # without --envs every mode gets --malloc-mmap-threshold and --thp: named "alloc" when they are the defaults
    flags_env = "alloc" if (args.malloc_mmap_threshold, args.thp) == (1 << 20, 1) else "flags"
    per_round: dict = {m: [] for m in modes}
    for r in range(args.rounds):
        for mode, env in (modes if r % 2 == 0 else modes[::-1]):
            per_round[mode, env].append(run_mode(mode, args, extra, env))
            print(f"round {r + 1}: {mode} {env or flags_env} done", file=sys.stderr, flush=True)
    results = {}
    for (mode, env), rounds in per_round.items():
        medians = [statistics.median(t for row in rows for t in row["times"]) for rows in rounds]
        peaks = [max(row["peak_rss"] for row in rows) for rows in rounds]
        all_times = sorted(t for rows in rounds for row in rows for t in row["times"])
        results[f"{mode}@{env}" if env else mode] = {
            "mode": mode,
            "env": env or flags_env,
            "step_s": statistics.median(medians), "step_s_range": [min(medians), max(medians)],
            "p90_s": all_times[int(0.9 * (len(all_times) - 1))],
            "peak_rss": statistics.median(peaks), "peak_rss_range": [min(peaks), max(peaks)],
            "step_s_rounds": medians, "peak_rss_rounds": peaks,  # in round order: rounds pair across modes
            "end_rss": statistics.median(max(row["end_rss"] for row in rows) for rows in rounds),
            "cpu_s": statistics.median(statistics.median(row["cpu_s"] for row in rows) for rows in rounds),
            "sys_s": statistics.median(statistics.median(row["sys_s"] for row in rows) for rows in rounds),
            "faults": statistics.median(statistics.median(row["faults"] for row in rows) for rows in rounds),
            "states": rounds[0][0]["states"], "psi": rounds[0][0]["psi"],
            "bytes_sent": max(row["bytes_sent"] for row in rounds[0]),
            "loss": next(row["loss"] for row in rounds[0] if row["rank"] == 0),
        }
    print_table(results, args)
    by_round = savings_by_round(results)
    if args.rounds > 1 and by_round:
        print("\nrealized saving round by round (each round's stage 0 in the same environment): " + ", ".join(
            f"{k} {' '.join(f'{x:.2f}' for x in xs)}" for k, xs in by_round.items()))
    print("\nloss at the last step, rank 0: " + ", ".join(f"{k} {r['loss']:.6f}" for k, r in results.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


def saving_reference(results: dict, r: dict) -> tuple[dict, int] | None:
    """``(stage 0's row in r's environment, the model-state bytes r saves against it in theory)`` for a row
    ``r`` of ``results`` that reports model states and is not stage 0 or DDP, or None (no stage 0 beside it,
    or nothing saved in theory). The realized saving is ``(stage 0's peak RSS - r's) / theory``."""
    s0 = next((b for b in results.values() if b["mode"] == "0" and b["env"] == r["env"]), None)
    if s0 is None or not r["states"] or r["mode"] in ("0", "ddp"):
        return None
    theory = sum(s0["states"].values()) - sum(r["states"].values())
    return (s0, theory) if theory > 0 else None


def savings_by_round(results: dict) -> dict[str, list[float]]:
    """Realized / theoretical saving of each zerorun stage above 0, round by round: round i's peak RSS against
    round i's stage 0 in the same environment (the rounds interleave the modes, so round i of each mode ran in
    the same stretch of time). The median of the rounds' peaks can pair a high stage 0 with a low stage 3; this
    shows each pairing. Key: the result's key; values: one fraction per round (dimensionless)."""
    out = {}
    for key, r in results.items():
        ref = saving_reference(results, r) if r["mode"].isdigit() else None
        if ref:
            s0, theory = ref
            out[key] = [(a - b) / theory for a, b in zip(s0["peak_rss_rounds"], r["peak_rss_rounds"])]
    return out


def print_table(results: dict, args) -> None:
    """The markdown table of ``results`` (key -> row of :func:`main`): step time against DDP in the same
    environment and against DDP in the default environment (as torchrun runs it)."""
    n = args.nproc
    psi = next(iter(results.values()))["psi"]
    print(f"\n{n} ranks, GPT {args.layers}x{args.d_model}, vocab {args.vocab}, seq {args.seq}, micro-batch "
          f"{args.micro_batch}, Ψ = {psi:,} parameters, fp32 AdamW; {args.rounds} rounds x {args.steps} steps; "
          f"step time and peak RSS: median of the rounds' medians (range over rounds)\n")
    for name, (env, how) in ENVS.items():
        print(f"environment {name}: {' '.join(f'{k}={v}' for k, v in env.items()) or 'none set'}"
              f"{', rank calls ' + how if how else ''}")
    print("\n| mode | env | median step (s) | vs DDP same env | vs DDP default env | peak RSS/rank (MiB) "
          "| RSS at step end (MiB) | CPU s/step/rank (kernel) | page faults/step/rank | model states/rank (MiB) "
          "| realized / theoretical saving vs stage 0 | sent/rank/step vs ZeRO §7 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    ddp_default = next((r["step_s"] for r in results.values() if r["mode"] == "ddp" and r["env"] == "default"),
                       None)
    for r in results.values():
        base = next((b["step_s"] for b in results.values() if b["mode"] == "ddp" and b["env"] == r["env"]), None)
        mode = r["mode"]
        states = sum(r["states"].values()) if r["states"] else None
        ref = saving_reference(results, r)
        saving = f"{(ref[0]['peak_rss'] - r['peak_rss']) / ref[1]:.2f}" if ref else "-"
        comm = "-"
        if mode.isdigit():
            comm = f"{r['bytes_sent'] / ((3 if mode == '3' else 2) * psi * (n - 1) / n * 4):.3f}"
        label = {"ddp": "DDP (torch)", "fsdp2": "FSDP2 (torch fully_shard)", "ds2": "DeepSpeed ZeRO-2",
                 "ds3": "DeepSpeed ZeRO-3", "ds2b": "DeepSpeed ZeRO-2, zerorun's buckets",
                 "ds3b": "DeepSpeed ZeRO-3, zerorun's buckets"}.get(mode, f"zerorun stage {mode}")
        lo, hi = r["step_s_range"]
        plo, phi = r["peak_rss_range"]
        same = f"{r['step_s'] / base:.3f}x" if base else "-"
        default = f"{r['step_s'] / ddp_default:.3f}x" if ddp_default else "-"
        print(f"| {label} | {r['env']} | {r['step_s']:.3f} ({lo:.2f}-{hi:.2f}) | {same} | {default} | "
              f"{r['peak_rss'] / 2**20:.0f} ({plo / 2**20:.0f}-{phi / 2**20:.0f}) | {r['end_rss'] / 2**20:.0f} | "
              f"{r['cpu_s']:.2f} ({r['sys_s']:.2f}) | {r['faults']:.0f} | "
              f"{states / 2**20 if states else float('nan'):.0f} | {saving} | {comm} |")


if __name__ == "__main__":
    main()
