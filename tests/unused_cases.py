"""Parameters no rank uses in a step (Note [Unused parameters] in zerorun/zero/masters.py), run on spawned
gloo ranks by test_unused.py: each stage against DDP (``find_unused_parameters=True``) and the same torch
optimizer, which leaves such a parameter's grad None and skips it (no decay, no momentum, no step count)."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from zerorun import checkpoint
from zerorun.zero import ZeroConfig, initialize


class Alternating(nn.Module):
    """A multi-task model: block ``a`` on odd calls, block ``b`` on even ones, on every rank; ``c`` never."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.a, self.b, self.head = (nn.Linear(8, 8) for _ in range(4))
        self.c = nn.Linear(8, 3)  # never used: never stepped, weight decay or not
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        h = torch.tanh(self.inp(x))
        h = torch.tanh((self.a if self.calls % 2 else self.b)(h))
        return self.head(h).square().mean()


def _x(step: int, micro: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + 10 * micro + rank))


def _engine(model: nn.Module, stage: int, optimizer: str, kwargs: dict, zero: dict):
    return initialize(model, optimizer=optimizer, optimizer_kwargs=dict(kwargs),
                      param_groups=[{"params": list(model.parameters())}], config=ZeroConfig(stage=stage, **zero))


def _zero_steps(engine, steps: range, accum: int) -> None:
    rank = dist.get_rank()
    for s in steps:
        for micro in range(accum):
            engine.backward(engine(_x(s, micro, rank)))
        engine.step()


def _reference(steps: int, accum: int, optimizer: str, kwargs: dict) -> dict[str, torch.Tensor]:
    """DDP + the torch optimizer (zero_grad(set_to_none=True), torch's default) after ``steps`` steps."""
    torch.manual_seed(0)
    ref = DDP(Alternating(), find_unused_parameters=True)
    opt = getattr(torch.optim, optimizer)(ref.parameters(), **kwargs)
    rank = dist.get_rank()
    for s in range(steps):
        for micro in range(accum):
            if micro + 1 < accum:
                with ref.no_sync():
                    (ref(_x(s, micro, rank)) / accum).backward()
            else:
                (ref(_x(s, micro, rank)) / accum).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return ref.module.state_dict()


def _worst(sd: dict, ref: dict) -> dict:
    """The largest relative difference over the whole model, and the never-used block's (it must not move)."""
    rel = max(float((sd[k].float() - v).abs().max() / v.abs().max().clamp_min(1e-12)) for k, v in ref.items())
    return {"rel": rel, "c_moved": float((sd["c.weight"] - ref["c.weight"]).abs().max())}


def alternating(stage: int, optimizer: str = "AdamW", kwargs: dict | None = None, zero: dict | None = None,
                steps: int = 4, accum: int = 1) -> dict:
    """``steps`` steps of :class:`Alternating` at ``stage`` against DDP; ``zero``: more ZeroConfig fields."""
    kwargs = kwargs or {"lr": 1e-2, "weight_decay": 0.1}
    ref = _reference(steps, accum, optimizer, kwargs)
    torch.manual_seed(0)
    engine = _engine(Alternating(), stage, optimizer, kwargs, dict(zero or {}, grad_accum_steps=accum))
    _zero_steps(engine, range(steps), accum)
    out = _worst(engine.full_state_dict(rank0_only=False), ref)
    engine.close()
    return out


def resumed(root: str, save_stage: int, load_stage: int, save_at: int, optimizer: str = "AdamW",
            kwargs: dict | None = None, zero: dict | None = None, steps: int = 4) -> dict:
    """Train at ``save_stage``, save after ``save_at`` steps, load into a fresh engine (another seed) at
    ``load_stage`` with ``zero``, train to ``steps``: against DDP trained ``steps`` steps without a break."""
    kwargs = kwargs or {"lr": 1e-2, "weight_decay": 0.1}
    ref = _reference(steps, 1, optimizer, kwargs)
    torch.manual_seed(0)
    first = _engine(Alternating(), save_stage, optimizer, kwargs, {})
    _zero_steps(first, range(save_at), 1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(first.optimizer, lambda s: 1.0)
    path, _, _ = checkpoint.save(first, root, save_at, scheduler=scheduler, position=checkpoint.DataPosition(),
                                 recipe={"train": {"micro_batch_size": 4}}, keep=1)
    first.close()
    torch.manual_seed(1)
    model = Alternating()
    model.calls = save_at  # the model's own schedule of blocks continues
    engine = _engine(model, load_stage, optimizer, kwargs, dict(zero or {}))
    scheduler = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, lambda s: 1.0)
    checkpoint.load(path, engine, scheduler=scheduler, micro_batch_size=4)
    _zero_steps(engine, range(save_at, steps), 1)
    out = _worst(engine.full_state_dict(rank0_only=False), ref)
    engine.close()
    return out


def zero_grad_loop(stage: int, precision: str = "fp32") -> dict:
    """The usual torch loop calls ``engine.optimizer.zero_grad()`` before each step: the parameters must move
    exactly as without the call (the optimizer's gradients are given at each step, not aliased once)."""
    finals = []
    for call in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))
        before = {k: v.clone().float() for k, v in model.state_dict().items()}
        engine = initialize(model, optimizer="SGD", optimizer_kwargs={"lr": 0.5},
                            config=ZeroConfig(stage=stage, precision=precision))
        for s in range(3):
            if call:
                engine.optimizer.zero_grad()
            engine.backward(engine(_x(s, 0, dist.get_rank()).repeat(1, 2)).square().mean())
            engine.step()
        finals.append(engine.full_state_dict(rank0_only=False))
    moved = max(float((finals[1][k].float() - v).abs().max()) for k, v in before.items())
    differ = max(float((finals[1][k] - v).abs().max()) for k, v in finals[0].items())
    return {"moved": moved, "differ": differ}


def accum_dtype_step(stage: int, accum: int = 2) -> dict:
    """fp32 training, ``grad_accum_dtype: bf16``, one SGD step (lr 1) over ``accum`` micro-steps: the engine's
    step against the same step computed here with each rank's micro-step gradients summed in bf16 as the
    engine sums them (stages 0-1: a bf16 accumulator; 2-3 keep their reduced slice in fp32, promoted), then
    averaged over the ranks in fp32. Returns the largest difference of the parameters."""
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))
    ref = copy.deepcopy(model)
    total = [torch.zeros_like(p) for p in ref.parameters()]
    for r in range(world):
        acc = None
        for micro in range(accum):
            ref.zero_grad(set_to_none=True)
            (ref(_x(0, micro, r).repeat(1, 2)).square().mean() / accum).backward()
            g = [p.grad for p in ref.parameters()]
            if stage >= 2 or acc is None:
                acc = [a + b for a, b in zip(acc, g)] if acc is not None else [b.bfloat16() if stage < 2 else b
                                                                             for b in g]
            else:
                acc = [(a.float() + b).bfloat16() for a, b in zip(acc, g)]
        total = [t + a.float() / world for t, a in zip(total, acc)]
    with torch.no_grad():
        for p, t in zip(ref.parameters(), total):
            p -= t
    engine = initialize(model, optimizer="SGD", optimizer_kwargs={"lr": 1.0},
                        config=ZeroConfig(stage=stage, grad_accum_steps=accum, grad_accum_dtype="bf16"))
    for micro in range(accum):
        engine.backward(engine(_x(0, micro, rank).repeat(1, 2)).square().mean())
    engine.step()
    sd = engine.full_state_dict(rank0_only=False)
    return {"error": max(float((sd[k] - v).abs().max()) for k, v in ref.state_dict().items())}
