"""The rank side of ``benchmarks/gpu_check.py`` (started by torchrun; see there). One process group per run;
every (precision, runtime) case in turn: parity against a DDP reference, then a fresh model for peak memory,
samples/s, host syncs and the profiler's communication overlap. Prints one JSON line per case after
``PREFIX``. Every tensor of a collective is on this rank's device (``--device``)."""

from __future__ import annotations

import copy
import gc
import json
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
PREFIX = "GPUCHECK "
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def build(args):
    from zerorun.rank.userload import build_model

    torch.manual_seed(0)
    spec = (os.path.join(ROOT, "recipes/models/gpt.py"), "build_model",
            dict(vocab_size=args.vocab, n_layer=args.layers, n_head=args.heads, d_model=args.d_model,
                 max_seq_len=args.seq, tie_embeddings=False))
    return build_model(*spec)


def batches(args, device, n: int, offset: int = 0) -> list[torch.Tensor]:
    """``n`` token batches of this rank (``(micro_batch, seq + 1)`` int64), made on the host, moved once."""
    rank = dist.get_rank()
    out = []
    for i in range(n):
        g = torch.Generator().manual_seed(1000 * (i + offset) + rank)
        out.append(torch.randint(0, args.vocab, (args.micro_batch, args.seq + 1), generator=g).to(device))
    return out


class Reference:
    """DDP as a user writes it at ``precision``: fp32, the model under DDP with torch's AdamW and
    ``clip_grad_norm_``; bf16, the model cast to bf16 under DDP (bf16 gradients all-reduced) with one fp32
    master per parameter, clipped and stepped in fp32, cast back (zerorun's Note [Mixed precision])."""

    def __init__(self, model, precision: str, device, lr: float, clip: float) -> None:
        from torch.nn.parallel import DistributedDataParallel as DDP

        self.model = model.to(device=device, dtype=DTYPES[precision])
        self.ddp = DDP(self.model, device_ids=[device] if device.type == "cuda" else None)
        self.params = list(self.model.parameters())
        self.masters = [p.detach().float().clone().requires_grad_(True) for p in self.params]
        from zerorun.zero import default_param_groups

        index = {p: i for i, p in enumerate(self.params)}
        groups = [dict(g, params=[self.masters[index[p]] for p in g["params"]])
                  for g in default_param_groups(self.model, 0.1)]
        self.opt = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))
        self.clip = clip

    def step(self, batch) -> tuple[float, float]:
        loss = self.ddp(batch)["loss"]
        loss.backward()
        for p, m in zip(self.params, self.masters):
            m.grad = p.grad.float()
            p.grad = None
        norm = torch.nn.utils.clip_grad_norm_(self.masters, self.clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for p, m in zip(self.params, self.masters):
                p.copy_(m)
        return float(loss), float(norm)


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def make_engine(args, runtime: str, model, precision: str):
    from zerorun import zero
    from zerorun.bench import baselines

    stage = int(runtime[5]) if runtime.startswith("stage") else 0  # "stage3", "stage3-qwz-qgz" (ZeRO++)
    config = zero.ZeroConfig(stage=stage, grad_clip=args.clip, units=("Block", "Embedding"), precision=precision,
                             bucket_mb=args.bucket_mb, quantize_grads="int8" if "qgz" in runtime else None,
                             quantize_weights="int8" if "qwz" in runtime else None)
    kwargs = dict(optimizer="AdamW", optimizer_kwargs={"lr": args.lr, "betas": (0.9, 0.95)},
                  param_groups=zero.default_param_groups(model, 0.1), config=config)
    if runtime.startswith("stage"):
        return zero.initialize(model, **kwargs)
    return baselines.initialize(runtime, model, **kwargs)


def parity(args, device, runtime: str, precision: str) -> dict:
    """Loss and grad norm per step and the final parameters of the engine against :class:`Reference` (largest
    relative differences; parameters over the whole model)."""
    base = build(args)
    ref = Reference(copy.deepcopy(base), precision, device, args.lr, args.clip)
    engine = make_engine(args, runtime, base.to(device), precision)
    out = {"loss": 0.0, "grad_norm": 0.0}
    for batch in batches(args, device, args.parity_steps):
        loss = engine(batch)["loss"]
        engine.backward(loss)
        norm = float(engine.step())
        ref_loss, ref_norm = ref.step(batch)
        out["loss"] = max(out["loss"], rel(float(loss), ref_loss))
        out["grad_norm"] = max(out["grad_norm"], rel(norm, ref_norm))
    state = engine.full_state_dict(rank0_only=False) if hasattr(engine, "full_state_dict") else \
        {k: v.detach().cpu() for k, v in engine.module.state_dict().items()}
    ref_state = {k: v.detach().cpu() for k, v in ref.model.state_dict().items()}
    diff = max(float((state[k].double() - v.double()).abs().max()) for k, v in ref_state.items())
    out["params"] = diff / max(float(v.double().abs().max()) for v in ref_state.values())
    engine.close()
    return out


def count_syncs(fn) -> tuple[int, list[str]]:
    """Host syncs ``fn()`` makes on CUDA (``torch.cuda.set_sync_debug_mode("warn")``'s warnings, with the
    Python line that made each); ``(0, [])`` without CUDA (nothing to count)."""
    if not torch.cuda.is_available():
        fn()
        return 0, []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    return len(syncs), sorted({f"{os.path.relpath(w.filename, ROOT)}:{w.lineno}" for w in syncs})


def _merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for s, e in sorted(spans):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def overlap_fraction(comm: list[tuple[int, int]], compute: list[tuple[int, int]]) -> float | None:
    """The fraction of the time some communication runs (union of ``comm`` spans, ns) during which some
    compute runs too (union of ``compute`` spans); ``None`` without communication."""
    comm, compute = _merged(comm), _merged(compute)
    total = sum(e - s for s, e in comm)
    if not total:
        return None
    hidden, j = 0, 0
    for s, e in comm:
        while j < len(compute) and compute[j][1] <= s:
            j += 1
        k = j
        while k < len(compute) and compute[k][0] < e:
            hidden += min(e, compute[k][1]) - max(s, compute[k][0])
            k += 1
    return hidden / total


def profile_overlap(step, n: int) -> dict:
    """Profile ``n`` calls of ``step``; communication: NCCL kernels on the GPU's timeline, else gloo's spans
    (its collectives run on host threads, CUDA tensors staged through the host); compute: the other GPU
    kernels (copies and memsets excluded), on CPU the ``aten::`` ops on threads that run no collective."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        for _ in range(n):
            step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    events = prof.profiler.kineto_results.events()
    span = [(e, (e.start_ns(), e.start_ns() + e.duration_ns())) for e in events if e.duration_ns() > 0]
    gpu = [(e, s) for e, s in span if e.device_type() == torch.autograd.DeviceType.CUDA]
    kernels = [(e, s) for e, s in gpu if "memcpy" not in e.name().lower() and "memset" not in e.name().lower()]
    comm = [s for e, s in kernels if "nccl" in e.name().lower()]
    source = "nccl kernels"
    if not comm:
        gloo = [(e, s) for e, s in span if e.name().startswith("gloo:")]
        comm, source = [s for _, s in gloo], "gloo spans"
        threads = {e.start_thread_id() for e, _ in gloo}
    else:
        threads = set()
    if gpu:
        compute = [s for e, s in kernels if "nccl" not in e.name().lower()]
    else:
        compute = [s for e, s in span if e.name().startswith("aten::") and e.start_thread_id() not in threads]
    return {"fraction": overlap_fraction(comm, compute), "comm_source": source, "comm_spans": len(comm)}


def estimate_row(args, model, stage: int, precision: str, world_size: int, device) -> dict:
    """``zerorun estimate``'s prediction for this model, stage and precision (bytes per rank)."""
    from zerorun.estimate.layout import layout_of
    from zerorun.estimate.policies import optimizer_model, precision_of
    from zerorun.estimate.report import Setup, estimate

    total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 2**40
    layout = layout_of(model, bucket_mb=args.bucket_mb, units=("Block", "Embedding"), weight_decay=0.1,
                       precision=precision)
    setup = Setup(nodes=1, procs_per_node=world_size, precision=precision_of(precision),
                  optimizer=optimizer_model("AdamW"), device_memory=total, device=device.type, cpu_memory=2**40,
                  bandwidth=1e10, micro_batch=args.micro_batch, seq_len=args.seq, bucket_mb=args.bucket_mb)
    [row] = [r for r in estimate(layout, setup).rows if r.stage == stage and r.offload == "none"]
    return {"model_states": row.model_states, "working_set": row.working_set, "activations": row.activations,
            "device_total": row.device_total}


def paper_bytes(psi: int, stage: int, precision: str, n: int) -> int:
    """Model states per rank (ZeRO §3, §5; Adam): fp32 4Ψ + 4Ψ + 8Ψ, mixed 2Ψ + 2Ψ + 12Ψ, each term divided
    by N from the stage that partitions it (stage 3: 16Ψ/N)."""
    p, g, k = (4, 4, 8) if precision == "fp32" else (2, 2, 12)
    return int(psi * (p / (n if stage >= 3 else 1) + g / (n if stage >= 2 else 1) + k / (n if stage >= 1 else 1)))


def measure(args, device, runtime: str, precision: str) -> dict:
    """A fresh model under ``runtime``: peak memory, samples/s, host syncs, communication overlap."""
    cuda = device.type == "cuda"
    data = batches(args, device, args.warmup + args.steps, offset=100)
    gc.collect()  # the parity run's models and engine
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    base = build(args).to(device)
    engine = make_engine(args, runtime, base, precision)
    cursor = iter(range(10**9))

    def micro():
        engine.backward(engine(data[next(cursor) % len(data)])["loss"])

    def step():
        micro()
        engine.step()

    for _ in range(args.warmup):
        step()
    if cuda:
        torch.cuda.synchronize(device)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    if cuda:
        torch.cuda.synchronize(device)
    step_s = (time.perf_counter() - t0) / args.steps
    peak = torch.cuda.max_memory_allocated(device) if cuda else None
    micro_syncs, micro_sites = count_syncs(micro)
    step_syncs, step_sites = count_syncs(engine.step)
    out = {"step_s": step_s, "samples_per_s": args.micro_batch * dist.get_world_size() / step_s,
           "peak_bytes": peak, "states": engine.memory_bytes(), "psi": engine.num_params,
           "syncs_per_micro_step": micro_syncs, "syncs_per_optimizer_step": step_syncs,
           "sync_sites": sorted(set(micro_sites + step_sites)),
           "overlap": profile_overlap(step, args.profile_steps)}
    if runtime.startswith("stage"):
        stage = int(runtime[5])
        out["paper_bytes"] = paper_bytes(out["psi"], stage, precision, dist.get_world_size())
        out["estimate"] = estimate_row(args, base, stage, precision, dist.get_world_size(), device)
    engine.close()
    del engine, base
    return out


def control_check() -> str:
    """The group zerorun's agreements are summed on beside this job's group (Note [Agreements on the host] in
    zerorun/zero/comm.py), made and used once: its backend, or the error."""
    from zerorun.zero.comm import control_group

    try:
        group = control_group(None)
        ones = torch.ones(2, dtype=torch.int64)
        dist.all_reduce(ones, group=group)
        return f"{dist.get_backend(group)}: {ones.tolist()}"
    except Exception as e:  # noqa: BLE001 - reported, the cases still run
        return f"{type(e).__name__}: {e}"


def writes_check(device) -> str:
    """Note [Writes between steps] (zerorun/zero/param_writes.py) on this device: a weight halved in place after
    each of two steps that change nothing (SGD, lr 0) keeps both halvings, with the masters on the device (stage 2,
    bf16) and in host memory (stage 1, fp32, optimizer offload ``cpu``): "kept", else the first that lost one, or
    the error."""
    from zerorun.zero import ZeroConfig, initialize

    try:
        for stage, precision, offload in ((2, "bf16", "none"), (1, "fp32", "cpu")):
            torch.manual_seed(0)
            model = torch.nn.Linear(16, 16).to(device)
            engine = initialize(model, optimizer="SGD", optimizer_kwargs={"lr": 0.0},
                                config=ZeroConfig(stage=stage, precision=precision, offload_optimizer=offload))
            first, x = model.weight.detach().clone(), torch.randn(4, 16, device=device)
            for write in (True, True, False):
                engine.backward(engine(x).float().square().mean())
                engine.step()
                if write:
                    with torch.no_grad():
                        model.weight.mul_(0.5)
            kept = torch.equal(model.weight.detach(), first * 0.25)
            engine.close()
            if not kept:
                return f"lost at stage {stage}, {precision}, optimizer offload {offload}"
        return "kept (stage 2 bf16, masters on the device; stage 1 fp32, optimizer offload cpu)"
    except Exception as e:  # noqa: BLE001 - reported, the cases still run
        return f"{type(e).__name__}: {e}"


def agreed_over_budget(t_start: float, budget_s: float, device) -> bool:
    """Whether any rank is past its time budget (a MAX all-reduce: every rank stops at the same case)."""
    flag = torch.tensor([1.0 if time.time() - t_start > budget_s else 0.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def main(args) -> None:
    t_start = time.time()
    cuda = args.device == "cuda"
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 parity: no TF32 in either runtime
        torch.backends.cudnn.allow_tf32 = False
    kwargs = {"device_id": device} if args.backend == "nccl" else {}
    dist.init_process_group(args.backend, **kwargs)
    control, writes = control_check(), writes_check(device)
    cases = [(p, r) for p in args.precisions.split(",") for r in args.runtimes.split(",")
             if p == "fp32" or r.startswith("stage")]  # the baselines run fp32 (zerorun/bench/baselines.py)
    for precision, runtime in cases:
        if agreed_over_budget(t_start, args.budget_s, device):
            row = {"precision": precision, "runtime": runtime, "skipped": "time budget spent"}
        else:
            row, t_case = {"precision": precision, "runtime": runtime}, time.perf_counter()
            try:
                if runtime.startswith("stage"):
                    row["parity"] = parity(args, device, runtime, precision)
                row.update(measure(args, device, runtime, precision))
            except Exception as e:  # noqa: BLE001 - reported in the summary, the other cases still run
                row["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
            row["case_s"] = round(time.perf_counter() - t_case, 2)
        row.update(rank=dist.get_rank(), world_size=dist.get_world_size(), backend=args.backend, control=control,
                   writes=writes, since_start_s=round(time.time() - t_start, 1))
        sys.stdout.write(PREFIX + json.dumps(row) + "\n")
        sys.stdout.flush()
        if cuda:
            torch.cuda.empty_cache()
    dist.destroy_process_group()


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(description="one rank of benchmarks/gpu_check.py (started by it through torchrun)")
    p.add_argument("--device", choices=("cuda", "cpu"), required=True)
    p.add_argument("--backend", choices=("nccl", "gloo"), required=True)
    p.add_argument("--budget-s", type=float, required=True)
    for name, kind in (("layers", int), ("d-model", int), ("heads", int), ("vocab", int), ("seq", int),
                       ("micro-batch", int), ("steps", int), ("warmup", int), ("parity-steps", int),
                       ("profile-steps", int), ("bucket-mb", float), ("lr", float), ("clip", float),
                       ("precisions", str), ("runtimes", str)):
        p.add_argument(f"--{name}", type=kind, required=True)
    main(p.parse_args())
