"""Host syncs of the optimizer step (issue 33 item 3, the step's part; item 7, scalar states after resume), run
on spawned gloo ranks by test_step_syncs.py. Micro-steps run outside the counter (test_host_syncs.py counts
them); only ``engine.step()`` is counted, in a steady step (after two warm-up steps)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from host_syncs import SYNC_READS, HostSyncCounter, _caller
from zerorun import checkpoint
from zerorun.zero import ZeroConfig, default_param_groups, initialize
from zerorun.zero.precision import LossScaleConfig


class StepSyncCounter(HostSyncCounter):
    """:class:`HostSyncCounter` that does not count reads of ``host`` tensors (ids) while they are on the CPU:
    the optimizer's scalar states (Adam's ``step``), which torch keeps on the CPU and reads with ``.item()``
    per parameter (no device sync). The same scalar on the device would be a sync per parameter: counted. Nor
    ``.numpy()``, which raises on a device tensor: disk offload's file I/O of its host buffers (``swap.py``)."""

    def __init__(self, host: set[int]) -> None:
        super().__init__()
        self.host = host

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", None) in SYNC_READS - {"numpy"}:
            on_host = bool(args) and id(args[0]) in self.host and args[0].device.type == "cpu"
            site = None if on_host else _caller()  # called here: the frames above are the same as the base's
            if site is not None:
                self.sites[site] += 1
        return func(*args, **(kwargs or {}))


def scalar_states(engine) -> list[torch.Tensor]:
    """Every 0-d optimizer state tensor (Adam's ``step``) of ``engine``'s optimizer."""
    return [v for s in engine.optimizer.state.values() for v in s.values()
            if isinstance(v, torch.Tensor) and v.dim() == 0]


def _engine(stage: int, zero: dict):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))
    zero = dict(zero)
    if zero.get("precision") == "fp16":
        zero["loss_scale"] = LossScaleConfig(initial_scale=2.0 ** 8)
    # 1 KiB buckets: several flat buffers, parameters cut by the rank boundaries; clipping on (and active)
    return initialize(model, optimizer="AdamW", optimizer_kwargs={"lr": 1e-2},
                      param_groups=default_param_groups(model, 0.1),
                      config=ZeroConfig(stage=stage, bucket_mb=0.001, grad_clip=0.05, **zero))


def _micro(engine, step: int) -> None:
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(10 * step + dist.get_rank()))
    engine.backward(engine(x).square().mean())


def _staging_ptrs(engine) -> list[int] | None:
    """Where cpu offload's host staging buffers are (``None`` without them)."""
    staging = getattr(engine.masters, "staging", None)
    if staging is None:
        return None
    return [t.data_ptr() for t in (staging.grads, staging.grad32, staging.out, staging.coef) if t is not None]


def _counted_step(engine, step: int) -> dict:
    _micro(engine, step)
    counter = StepSyncCounter({id(t) for t in scalar_states(engine)})
    calls = []
    hook = engine.optimizer.register_step_pre_hook(lambda *_: calls.append(1))
    before = _staging_ptrs(engine)
    with counter:
        norm = engine.step()
    hook.remove()
    return {"count": counter.count, "sites": dict(counter.sites), "norm": float(norm),
            "norm_type": type(norm).__name__, "skipped": engine.last_step_skipped, "optimizer_steps": len(calls),
            "buffers": len(engine.buffers), "staging_reused": before is not None and before == _staging_ptrs(engine),
            "kwargs": {k: engine.optimizer.defaults.get(k) for k in ("foreach", "fused")}}


def step_syncs(configs: list[tuple[int, dict]], swap: str) -> list[dict]:
    """For each ``(stage, zero fields)``: two steps, then a counted one."""
    out = []
    for stage, zero in configs:
        if zero.get("offload_optimizer") == "disk":
            zero = dict(zero, offload_path=swap, offload_buffer_mb=0.001)
        engine = _engine(stage, zero)
        for step in range(2):
            _micro(engine, step)
            engine.step()
        out.append(_counted_step(engine, 2))
        engine.close()
    return out


def _scheduler(engine):
    return torch.optim.lr_scheduler.LambdaLR(engine.optimizer, lambda s: 1.0)


def resumed_scalars(root: str, configs: list[tuple[int, dict]]) -> list[dict]:
    """For each config: two steps, a checkpoint, a fresh engine that loads it; the device and dtype of every
    scalar state after the load, and the counted next step."""
    out = []
    for i, (stage, zero) in enumerate(configs):
        engine = _engine(stage, zero)
        for step in range(2):
            _micro(engine, step)
            engine.step()
        path, _, _ = checkpoint.save(engine, f"{root}/{i}", 2, scheduler=_scheduler(engine),
                                     position=checkpoint.DataPosition(),
                                     recipe={"train": {"micro_batch_size": 8}}, keep=1)
        engine.close()
        engine = _engine(stage, zero)
        checkpoint.load(path, engine, scheduler=_scheduler(engine), micro_batch_size=8)
        scalars = scalar_states(engine)
        res = _counted_step(engine, 2)
        res["scalars"] = sorted({(str(t.device), str(t.dtype)) for t in scalars})
        res["n_scalars"] = len(scalars)
        out.append(res)
        engine.close()
    return out


class _Stop(Exception):
    pass


def scalar_targets_of_a_device_engine(stage: int) -> list[str]:
    """The devices of the scalar-state targets (``optim/<name>/step``) resume loads into, for an engine whose
    masters are on a device other than the CPU (the meta device stands in for a GPU here: the load stops
    before any value is read)."""
    from zerorun.zero import state

    engine = _engine(stage, {"precision": "fp32"})
    _micro(engine, 0)
    engine.step()
    _, layout = state.engine_state(engine)
    real = engine.master_slices
    engine.master_slices = lambda: [m.to("meta") for m in real()]
    seen = []

    def load(targets):
        seen.extend(str(v.device) for k, v in targets.items() if k.startswith("optim/") and k.endswith("/step"))
        raise _Stop

    try:
        state.load_engine_state(engine, layout, load)
    except _Stop:
        pass
    engine.close()
    return seen
