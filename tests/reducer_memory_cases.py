"""Cases run on every rank of a gloo group by tests/test_reducer.py: what the gradient reducer
(zerorun/zero/reducer.py) costs and how exactly it sums: live bytes per phase of a step, gradient accumulation's
error in bf16, the global gradient norm against an exact fp64 one. The models and the order/correctness cases
are in reducer_cases.py."""

from __future__ import annotations

import copy
import json
import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn

from reducer_cases import Stack
from zerorun.zero import ZeroConfig, initialize


def peak_bytes(stage: int, reverse: bool = False, width: int = 512, depth: int = 8, bucket_mb: float | None = None,
               optimizer: str = "AdamW") -> dict:
    """Live CPU tensor bytes (the profiler's allocator events) in the second step of :class:`Stack` (one
    bucket per layer by default), per phase: at the start of backward, the peak in backward, the peak in
    the optimizer step, and the peak of the whole step, all relative to the bytes live before the forward;
    plus Ψ (elements) and one bucket's bytes."""
    from torch.profiler import ProfilerActivity, profile, record_function

    rank = dist.get_rank()
    x = torch.randn(16, width, generator=torch.Generator().manual_seed(rank))
    torch.manual_seed(0)
    model = Stack(width, depth, reverse)
    psi = sum(p.numel() for p in model.parameters())
    bucket = width * width * 4
    engine = initialize(model, optimizer=optimizer, optimizer_kwargs={"lr": 1e-3},
                        config=ZeroConfig(stage=stage, bucket_mb=bucket_mb or bucket / 2**20,
                                          units=("Linear",) if stage == 3 else ()))
    engine.backward(engine(x))  # step 1: optimizer states created, launch order recorded
    engine.step()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with record_function("phase:forward"):
            loss = engine(x)
        with record_function("phase:backward"):
            engine.backward(loss)
        with record_function("phase:step"):
            engine.step()
    path = os.path.join(tempfile.mkdtemp(), f"trace{rank}.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    os.remove(path)
    mem = sorted((e["ts"], e["args"]["Total Allocated"], e["args"]["Bytes"]) for e in events
                 if e.get("name") == "[memory]" and e["args"].get("Device Type") == 0)
    base = mem[0][1] - mem[0][2]
    phases = {e["name"][6:]: (e["ts"], e["ts"] + e["dur"]) for e in events if str(e.get("name", "")).startswith("phase:")}
    out = {"psi": psi, "bucket": bucket, "cap": engine.MAX_INFLIGHT + 1, "world_size": dist.get_world_size()}
    t0, t1 = phases["backward"]
    out["backward_start"] = max([b - base for t, b, _ in mem if t < t0] or [0])
    for name, (t0, t1) in phases.items():
        out["peak_" + name] = max([b - base for t, b, _ in mem if t0 <= t <= t1] or [0])
    out["peak"] = max(out["peak_" + n] for n in phases)
    out["at_rest"] = sum(engine.memory_bytes().values())
    return out


def accumulation_error(stage: int, grad_accum_dtype: str | None, accum: int = 32, reduce_dtype: str | None = "fp32") -> float:
    """bf16, ``accum`` micro-steps, gradients reduced in fp32: the relative L2 error of this rank's reduced
    gradient slices against the bf16 micro-step gradients summed in float64 and averaged over ranks."""
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 1)).to(torch.bfloat16)
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(rank)
    xs = [torch.randn(8, 64, generator=g).to(torch.bfloat16) for _ in range(accum)]
    total = [torch.zeros(p.shape, dtype=torch.float64) for p in ref.parameters()]
    for x in xs:
        ref.zero_grad()
        (ref(x).float().square().mean() / accum).backward()
        for t, p in zip(total, ref.parameters()):
            t += p.grad.double()
    for t in total:
        dist.all_reduce(t)
        t /= n
    engine = initialize(model, optimizer="SGD", optimizer_kwargs={"lr": 1.0},
                        config=ZeroConfig(stage=stage, precision="bf16", reduce_dtype=reduce_dtype, grad_accum_steps=accum,
                                          grad_accum_dtype=grad_accum_dtype,
                                          units=("Linear",) if stage == 3 else ()))
    for x in xs:
        engine.backward(engine(x).float().square().mean())
    num = den = 0.0
    by_param = dict(zip(ref.parameters(), total))
    index = {id(p): q for p, q in zip(model.parameters(), ref.parameters())}
    for buf in engine.buffers:
        want = torch.zeros(buf.numel, dtype=torch.float64)
        for p in buf.params:
            buf.view_of(want, p).copy_(by_param[index[id(p)]])
        got = engine.reducer.grad_slice(buf).double()
        want = want if got.numel() == buf.numel else buf.shard(want)
        num += float((got - want).square().sum())
        den += float(want.square().sum())
    engine.step()
    return (num / den) ** 0.5


def norm_against_exact(stage: int, width: int = 2048) -> dict:
    """Note [Gradient norm]: one Linear of ``width``² weights (one bucket of 16 MiB at the default 25 MiB),
    inputs whose features span e^±6 so that the gradient's squares do too; the engine's norm and the exact one
    (each rank's gradient of its batch in fp64, averaged over ranks in fp64)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(rank)
    spread = torch.exp(2 * torch.randn(width, generator=torch.Generator().manual_seed(7)))  # same on every rank
    x = torch.randn(8, width, generator=gen) * spread
    torch.manual_seed(0)
    model = nn.Linear(width, width)
    ref = copy.deepcopy(model).double()
    ref(x.double()).square().mean().backward()
    grads = torch.cat([p.grad.reshape(-1) for p in ref.parameters()])
    dist.all_reduce(grads)
    exact = float(torch.linalg.vector_norm(grads / n))
    engine = initialize(model, optimizer="SGD", optimizer_kwargs={"lr": 1e-3}, config=ZeroConfig(stage=stage))
    engine.backward(engine(x).square().mean())
    return {"norm": float(engine.step()), "exact": exact}


RELEASE_SETUPS = {
    "stage0": dict(stage=0), "stage1": dict(stage=1), "stage2": dict(stage=2),
    "stage3": dict(stage=3, units=("Linear",)), "stage2-bf16": dict(stage=2, precision="bf16"),
    "stage1-fp16": dict(stage=1, precision="fp16"), "stage2-cpu-offload": dict(stage=2, offload_optimizer="cpu"),
    "stage3-disk-offload": dict(stage=3, units=("Linear",), offload_optimizer="disk", offload_params="disk"),
    "ddp": None, "fsdp2": None}


def released_when_dropped() -> dict[str, list[str]]:
    """Note [Hooks hold their owner weakly]: per setup, an engine trained one step, then dropped (no ``close()``)
    with its model: which of the engine and a parameter are still alive after ``gc.collect()`` (none should be:
    a user who builds engines in a loop, a notebook, a sweep, must get the memory back, as with DDP and FSDP2)."""
    import gc
    import weakref

    from zerorun.bench import baselines

    out = {}
    for name, setup in RELEASE_SETUPS.items():
        torch.manual_seed(0)
        model = Stack(32, 2)
        kwargs = dict(optimizer="AdamW", optimizer_kwargs={"lr": 1e-3})
        if setup is None:
            engine = baselines.initialize(name, model, config=ZeroConfig(units=("Linear",)), **kwargs)
        else:
            path = tempfile.mkdtemp() if "offload_params" in setup else None
            engine = initialize(model, config=ZeroConfig(offload_path=path, **setup), **kwargs)
        engine.backward(engine(torch.randn(4, 32)))
        engine.step()
        alive = {"engine": weakref.ref(engine), "parameter": weakref.ref(next(model.parameters()))}
        del engine, model
        gc.collect()
        out[name] = sorted(k for k, ref in alive.items() if ref() is not None)
    return out
