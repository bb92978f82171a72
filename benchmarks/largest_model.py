"""The largest GPT that trains under a fixed per-rank memory budget: zerorun's stage 3 against its peers.

    flock /tmp/zerorun-bigmem.lock python benchmarks/largest_model.py              # 3 GiB per rank, 2 ranks
    flock /tmp/zerorun-bigmem.lock python benchmarks/largest_model.py \
        --methods zerorun-s3,zerorun-s3-disk,fsdp2,fsdp2-zerorun-env,deepspeed-z3,deepspeed-z3-offload
    flock /tmp/zerorun-bigmem.lock python benchmarks/largest_model.py --budgets-gib 3,6
    python benchmarks/largest_model.py --quick      # a tiny budget and model, for a smoke check

For each budget and method, a search over depth (GPT blocks at ``--d-model`` 1024, small vocab, sequence and
micro-batch) finds the most blocks that train ``--steps`` optimizer steps on ``--nproc`` ranks, each rank in
its own memory cgroup (cgroup v1, ``memory.limit_in_bytes`` = the budget; a child of
``/sys/fs/cgroup/memory``, created per probe and removed after it). A cgroup, not an rlimit: RLIMIT_AS counts
address space, which torch reserves far beyond what it touches (it fails before any real limit), and
RLIMIT_RSS is not enforced by Linux; the cgroup counts what the rank really holds (anonymous memory and the
page cache it dirties, reclaimed before the rank is killed) and kills it with the kernel's OOM killer when it
needs more, as a container or a batch scheduler's limit would. A probe passes when every rank finishes; it
fails when the OOM killer ended a rank; any other failure stops the benchmark with the ranks' output.

The search starts from a guess (the budget over the per-block model-state bytes each method holds per rank),
goes up by 2x or down by 1/4 until it brackets the answer, then bisects down to ``--resolution`` of the depth.

Methods (``--methods``):
- ``zerorun-s3``: ``zero.initialize(stage=3)``, units = Block and Embedding, model built with
  ``zero.deferred_init`` (each rank materializes its slices only), fp32 AdamW.
- ``zerorun-s3-glibc``: the same, its ranks under glibc tuned (``ZERORUN_ALLOCATOR=glibc``) where
  ``zerorun-s3``'s get tcmalloc if this machine has it (Note [Rank allocator]).
- ``zerorun-s3-disk``: the same with ``zero.offload_optimizer="disk"`` (optimizer states and the step on
  disk, paged through a ``zero.offload_buffer_mb`` host buffer; files in a temporary folder).
- ``zerorun-s3-disk-params``: the same with ``zero.offload_params="disk"`` too (the parameter slices in a
  file-backed mapping, in memory only while their unit is gathered: Note [Parameter offload]).
- ``fsdp2``: torch's ``fully_shard`` per block and embedding, then the root, on a model built on the meta
  device (``to_empty`` + initialization of the local shards: the way FSDP2 trains models that do not fit one
  rank), ``reshard_after_forward=True``, fp32 AdamW.
- ``fsdp2-zerorun-env``: the same, its ranks in zerorun's rank environment (FSDP2 frees much more with it:
  docs/benchmarks.md, "The allocator").
- ``deepspeed-z3`` / ``deepspeed-z3-offload``: DeepSpeed ZeRO-3 as its users run it (``DS_ACCELERATOR=cpu``,
  gloo), the model built under ``deepspeed.zero.Init`` (each rank keeps its partitions as the modules are
  built), its AdamW from the config (weight decay 0.1 but on biases and norms, clipping 1.0), its defaults
  otherwise; ``-offload``: ``offload_optimizer: {device: cpu}`` (ZeRO-Offload's host step, DeepSpeedCPUAdam,
  which DeepSpeed compiles on first use); ``-buckets``: its reduce and prefetch buckets of zerorun's 25 MiB
  (its defaults, 5e8 and 5e7 elements, hold the whole model's gradient in one bucket here). When DeepSpeed
  is installed; skipped with a line otherwise. DeepSpeed's CPU Adam may abort the process at exit after the
  steps ("terminate called without an active exception"): a probe whose ranks all reported passes, and
  the log line says how the job exited.

The zerorun methods' ranks run in the environment zerorun's launcher gives its ranks on this machine
(``zerorun.allocator.allocator_env``: tcmalloc where installed, else glibc tuned; Note [Rank allocator]);
the peers' in the default environment (as torchrun starts them), except
``fsdp2-zerorun-env`` (and every peer with ``--peer-env zerorun``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PREFIX = "BENCH "
CGROUP_ROOT = "/sys/fs/cgroup/memory"
METHODS = ("zerorun-s3", "zerorun-s3-glibc", "zerorun-s3-disk", "zerorun-s3-disk-params", "fsdp2", "fsdp2-zerorun-env",
           "deepspeed-z3", "deepspeed-z3-buckets", "deepspeed-z3-offload")


def join_cgroup() -> None:
    """Move this process into its rank's cgroup (``$LM_CGROUP_PREFIX<LOCAL_RANK>``), before torch is imported."""
    prefix = os.environ.get("LM_CGROUP_PREFIX")
    if prefix:
        with open(os.path.join(prefix + os.environ["LOCAL_RANK"], "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))


def worker(args) -> None:
    join_cgroup()
    import resource

    import torch
    import torch.distributed as dist

    sys.path.insert(0, ROOT)
    from zerorun import zero
    from zerorun.rank.userload import build_model

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if args.worker.startswith("deepspeed"):
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    else:
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    spec = (os.path.join(ROOT, "recipes/models/gpt.py"), "build_model",
            dict(vocab_size=args.vocab, n_layer=args.layers, n_head=args.heads, d_model=args.d_model,
                 max_seq_len=args.seq, tie_embeddings=False))
    opt_kwargs = {"lr": 1e-4, "betas": (0.9, 0.95)}
    if args.worker.startswith("fsdp2"):
        from torch.distributed.fsdp import fully_shard

        with torch.device("meta"):
            model = build_model(*spec)
        for module in [*model.blocks, model.tok_emb, model.pos_emb]:
            fully_shard(module, reshard_after_forward=True)
        fully_shard(model, reshard_after_forward=True)
        model.to_empty(device="cpu")
        with torch.no_grad():  # each rank initializes its shards (GPT's init: normal(0, 0.02), zero biases)
            for name, p in model.named_parameters():
                local = p.to_local()
                local.normal_(0.0, 0.02) if p.dim() > 1 else local.zero_()
                if name.endswith(".weight") and ("ln" in name or "norm" in name):
                    local.fill_(1.0)
        opt = torch.optim.AdamW(zero.default_param_groups(model, 0.1), **opt_kwargs)

        def step(batch):
            model(batch)["loss"].backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
        psi = sum(p.numel() for p in model.parameters())
    elif args.worker.startswith("deepspeed"):
        zero_cfg = {"stage": 3}
        if args.worker.endswith("buckets"):  # reduce and prefetch buckets of zerorun's 25 MiB, not DeepSpeed's
            zero_cfg.update(reduce_bucket_size=25 * 2**20 // 4, stage3_prefetch_bucket_size=25 * 2**20 // 4)
        if args.worker.endswith("offload"):  # ZeRO-Offload: optimizer states and step on the host (DeepSpeedCPUAdam)
            zero_cfg["offload_optimizer"] = {"device": "cpu"}
        config = {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": 1,
                  "gradient_clipping": 1.0, "zero_optimization": zero_cfg,
                  "optimizer": {"type": "AdamW", "params": dict(opt_kwargs, weight_decay=0.1)}}
        with deepspeed.zero.Init(config_dict_or_path=config):  # each rank keeps its partitions as modules are built
            model = build_model(*spec)
        eng, _, _, _ = deepspeed.initialize(model=model, model_parameters=zero.default_param_groups(model, 0.1),
                                            config=config, dist_init_required=False)

        def step(batch):
            eng.backward(eng(batch)["loss"])
            eng.step()
        psi = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    else:
        model = zero.deferred_init(build_model, *spec)
        engine = zero.initialize(
            model, optimizer="AdamW", optimizer_kwargs=opt_kwargs, param_groups=zero.default_param_groups(model, 0.1),
            config=zero.ZeroConfig(stage=3, grad_clip=1.0, units=("Block", "Embedding"),
                                   offload_optimizer="disk" if "disk" in args.worker else "none",
                                   offload_params="disk" if args.worker.endswith("params") else "none",
                                   offload_path=args.offload_path))

        def step(batch):
            engine.backward(engine(batch)["loss"])
            engine.step()
        psi = engine.num_params
    g = torch.Generator().manual_seed(rank)
    times = []
    for _ in range(args.steps):
        batch = torch.randint(0, args.vocab, (args.micro_batch, args.seq + 1), generator=g)
        t0 = time.perf_counter()
        step(batch)
        times.append(time.perf_counter() - t0)
    dist.barrier()
    out = {"rank": rank, "psi": psi, "times": times,
           "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    sys.stdout.write(PREFIX + json.dumps(out) + "\n")
    sys.stdout.flush()
    dist.destroy_process_group()


def rank_env(method: str, args) -> dict[str, str]:
    """The environment variables of ``method``'s ranks: zerorun's launcher's for zerorun (and for the peers with
    ``--peer-env zerorun``), none for the peers (as torchrun starts them)."""
    sys.path.insert(0, ROOT)
    from zerorun.allocator import allocator_env, find_mimalloc, find_tcmalloc, rank_env as zerorun_env

    zerorun_like = method.startswith("zerorun") or method.endswith("zerorun-env") or args.peer_env == "zerorun"
    if method.endswith("-glibc"):
        return allocator_env({**zerorun_env(), "ZERORUN_ALLOCATOR": "glibc"}, None)
    return allocator_env(zerorun_env(), find_tcmalloc(), find_mimalloc()) if zerorun_like else {}


def probe(method: str, layers: int, budget: int, args) -> dict:
    """Train ``layers`` blocks with ``method`` on ``args.nproc`` ranks, each limited to ``budget`` bytes.

    Returns:
        ``{"ok": bool, "layers", "psi", "peak_rss" (max over ranks, bytes), "cgroup_max" (max over ranks of
        the cgroup's ``memory.max_usage_in_bytes``), "step_s" (median), "wall_s", "exit"}``; ``ok`` when every
        rank reported its steps (``exit``: the job's exit status, not 0 where a rank crashed after reporting),
        False when the OOM killer ended a rank. Exits with the ranks' output on any other failure.
    """
    sys.path.insert(0, ROOT)
    from zerorun.launch.plan import free_port

    # one name per probe: a rank's child that outlives it (a compiler DeepSpeed started) keeps its cgroup busy
    group = os.path.join(CGROUP_ROOT, f"zerorun-largest-{os.getpid()}-{time.monotonic_ns()}-")
    tmp = tempfile.mkdtemp(prefix="zerorun-largest-", dir=args.offload_dir)
    cgroups = [group + str(r) for r in range(args.nproc)]
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.nproc}",
           f"--master-port={free_port()}", "--master-addr=127.0.0.1", os.path.abspath(__file__),
           "--worker", method, f"--layers={layers}", f"--d-model={args.d_model}", f"--heads={args.heads}",
           f"--vocab={args.vocab}", f"--seq={args.seq}", f"--micro-batch={args.micro_batch}",
           f"--steps={args.steps}", f"--offload-path={tmp}"]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // args.nproc)),
           "LM_CGROUP_PREFIX": group, **rank_env(method, args)}
    t0 = time.perf_counter()
    try:
        for cg in cgroups:
            os.mkdir(cg)
            with open(os.path.join(cg, "memory.limit_in_bytes"), "w") as f:
                f.write(str(budget))
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.probe_timeout)
        wall = time.perf_counter() - t0
        kills = sum(_oom_kills(cg) for cg in cgroups)
        cg_max = max(int(open(os.path.join(cg, "memory.max_usage_in_bytes")).read()) for cg in cgroups)
    finally:
        for cg in cgroups:
            _remove_cgroup(cg)
        shutil.rmtree(tmp, ignore_errors=True)
    rows = [json.loads(line[len(PREFIX):]) for line in proc.stdout.splitlines() if line.startswith(PREFIX)]
    if len(rows) == args.nproc:  # every rank trained its steps (DeepSpeed's CPU Adam may abort at exit after)
        return {"ok": True, "layers": layers, "psi": rows[0]["psi"], "wall_s": wall, "cgroup_max": cg_max,
                "exit": proc.returncode,
                "peak_rss": max(r["peak_rss"] for r in rows),
                "step_s": statistics.median(t for r in rows for t in r["times"])}
    if kills:
        return {"ok": False, "layers": layers, "wall_s": wall, "cgroup_max": cg_max}
    sys.exit(f"{method} at {layers} blocks failed (exit {proc.returncode}) without an OOM kill:\n"
             f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def _oom_kills(cg: str) -> int:
    with open(os.path.join(cg, "memory.oom_control")) as f:
        return next((int(line.split()[1]) for line in f if line.startswith("oom_kill ")), 0)


def _remove_cgroup(cg: str) -> None:
    for _ in range(50):  # the killed ranks' memory is uncharged once they are reaped
        try:
            os.rmdir(cg)
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.1)
    print(f"warning: could not remove {cg}", file=sys.stderr)


def guess(method: str, budget: int, args) -> int:
    """A first depth to probe: the budget (less 600 MiB for torch and the embeddings) over the model-state
    bytes per block per rank (16 bytes per parameter over N ranks for fp32 AdamW, ZeRO §5; 8 with the
    optimizer on disk, 4 with the parameters too)."""
    per_param = 4 if method.endswith("params") else 8 if method.endswith(("disk", "offload")) else 16
    per_block = 12 * args.d_model ** 2 * per_param
    return max(1, int((budget - (600 << 20)) / (per_block / args.nproc)))


def search(method: str, budget: int, args, log) -> dict | None:
    """The most blocks ``method`` trains under ``budget`` bytes per rank (see the module docstring); None when
    even one block does not fit."""
    ok: dict | None = None
    bad: int | None = None
    depth = guess(method, budget, args)
    while True:
        r = probe(method, depth, budget, args)
        crash = f", then exit {r['exit']}" if r.get("exit") else ""
        log(f"{method} @ {budget / 2**30:g} GiB: {depth} blocks {'ok' if r['ok'] else 'OOM'}{crash} "
            f"({r['wall_s']:.0f} s, cgroup max {r['cgroup_max'] / 2**20:.0f} MiB)")
        if r["ok"]:
            ok = r
        else:
            bad = depth
        lo = ok["layers"] if ok else 0
        if bad is None:
            depth = lo * 2
        elif bad - lo <= max(1, int(lo * args.resolution)):
            return ok
        else:
            # bisect a bracket; without a passing depth yet, step down by a quarter (the guess is near)
            depth = (lo + bad) // 2 if ok else (bad * 3) // 4
            if depth == 0 or depth == lo:
                return ok


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--offload-path", help=argparse.SUPPRESS)
    p.add_argument("--layers", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--methods", default="zerorun-s3,fsdp2-zerorun-env,deepspeed-z3",
                   help="comma-separated, of: " + ", ".join(METHODS) + " (the default, ~12 min here, compares "
                   "stage 3 with FSDP2 in the same environment)")
    p.add_argument("--budgets-gib", default="3", help="per-rank memory budgets, GiB, comma-separated")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--resolution", type=float, default=0.05,
                   help="stop when the bracket is within this fraction of the depth found (1 block at least)")
    p.add_argument("--peer-env", choices=("torchrun", "zerorun"), default="torchrun",
                   help="the peers' environment: torchrun's default, or zerorun's ranks'")
    p.add_argument("--offload-dir", default=None, help="folder for the disk-offload files (default: the temp dir)")
    p.add_argument("--probe-timeout", type=float, default=900)
    p.add_argument("--quick", action="store_true", help="a 0.75 GiB budget, d_model 256: a smoke check")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    if args.quick:
        args.budgets_gib, args.d_model, args.heads, args.vocab = "0.75", 256, 4, 1024
    if args.worker:
        worker(args)
        return
    if not os.access(CGROUP_ROOT, os.W_OK):
        sys.exit(f"{CGROUP_ROOT} is not writable: the budget is a memory cgroup per rank (cgroup v1, root)")
    budgets = [int(float(b) * 2**30) for b in args.budgets_gib.split(",")]
    if max(budgets) * args.nproc > 12 * 2**30:
        sys.exit("budget x ranks is above 12 GiB (this machine's rule for one benchmark)")
    try:
        import deepspeed  # noqa: F401
        have_ds = True
    except ImportError:
        have_ds = False
    ds_methods = [m for m in args.methods.split(",") if m.startswith("deepspeed")]
    if have_ds and ds_methods:
        # DeepSpeed compiles its ops on first use (shared-memory collectives, FusedAdam; CPU Adam with offload):
        # here, once, before the search. Inside a probe the compiler would spend the probe's memory budget, and
        # a compiler the OOM killer ends leaves a lock in the extensions folder that every later load waits on.
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        from deepspeed.accelerator import get_accelerator

        ops = ["ShareMemCommBuilder", "FusedAdamBuilder"] + (["CPUAdamBuilder"] if "deepspeed-z3-offload" in ds_methods
                                                             else [])
        for op in ops:
            get_accelerator().create_op_builder(op).load()
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    results = []
    t_start = time.perf_counter()
    for budget in budgets:
        for method in args.methods.split(","):
            if method not in METHODS:
                sys.exit(f"--methods: unknown method {method!r} (one of {', '.join(METHODS)})")
            if method.startswith("deepspeed") and not have_ds:
                print(f"{method}: skipped, DeepSpeed is not installed in this Python (docs/benchmarks.md, "
                      "\"DeepSpeed beside them\": a virtual environment with it)")
                continue
            best = search(method, budget, args, log)
            results.append({"budget": budget, "method": method, **(best or {"layers": 0})})
    print(f"\n{args.nproc} ranks, GPT d_model {args.d_model}, {args.heads} heads, vocab {args.vocab}, seq "
          f"{args.seq}, micro-batch {args.micro_batch}, fp32 AdamW, {args.steps} steps; budget = memory cgroup "
          f"limit per rank; peers in the {args.peer_env} environment (-zerorun-env: zerorun's); "
          f"search {time.perf_counter() - t_start:.0f} s\n")
    print("| budget/rank | method | largest depth | parameters | peak RSS/rank (MiB) | cgroup peak/rank (MiB) "
          "| step (s) | vs best peer |")
    print("|---|---|---|---|---|---|---|---|")
    for budget in budgets:
        rows = [r for r in results if r["budget"] == budget]
        peers = [r.get("psi", 0) for r in rows if not r["method"].startswith("zerorun")]
        best_peer = max(peers) if peers else 0
        for r in rows:
            ratio = f"{r['psi'] / best_peer:.2f}x" if best_peer and r.get("psi") else "-"
            print(f"| {budget / 2**30:g} GiB | {r['method']} | {r['layers']} | {r.get('psi', 0) / 1e6:.0f}M | "
                  f"{r.get('peak_rss', 0) / 2**20:.0f} | {r.get('cgroup_max', 0) / 2**20:.0f} | "
                  f"{r.get('step_s', float('nan')):.1f} | {ratio} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
