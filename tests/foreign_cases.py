"""Cases run on every rank of a gloo group by tests/test_foreign_backward.py (Note [Backward outside
engine.backward] in zerorun/zero/stage3_schedule.py): ``torch.autograd.grad`` over the model around its
``engine.backward``, at stage 3 against stage 0."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from zerorun.zero import ZeroConfig, initialize
from zerorun.zero.units import UnitState


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(12, 15), nn.Linear(15, 12)

    def forward(self, h):
        return h + self.fc2(torch.tanh(self.fc1(h)))


class Net(nn.Module):
    """``inside``: the forward adds an input-gradient penalty of its own (``"create_graph"``: trained through, as
    a gradient penalty; ``"detached"``: computed without a graph, a constant term; ``"retry"``: trained through,
    after a first try whose pass raised midway)."""

    def __init__(self, inside: str = "") -> None:
        super().__init__()
        self.inside = inside
        self.inp, self.blocks, self.head = nn.Linear(7, 12), nn.ModuleList(Block() for _ in range(2)), nn.Linear(12, 5)

    def forward(self, x, y):
        logits = self.head(self.blocks[1](self.blocks[0](self.inp(x))))
        loss = F.cross_entropy(logits, y)
        if self.inside:
            if self.inside == "retry":  # a first try whose pass raises midway, caught; then with a graph
                _try_raising(logits, x)
            g, = torch.autograd.grad(logits.square().sum(), x, create_graph=self.inside != "detached",
                                     retain_graph=True)
            loss = loss + 0.1 * g.square().mean()
        return loss, logits


def _batch(step: int, micro: int):
    g = torch.Generator().manual_seed(100 * step + 10 * micro + dist.get_rank())
    return torch.randn(6, 7, generator=g).requires_grad_(), torch.randint(0, 5, (6,), generator=g)


def train(stage: int, pattern: str, keep: int | None = None, units: tuple = ("Block",), accum: int = 1,
          steps: int = 3) -> dict:
    """``pattern``: ``"fgsm"`` (the input's gradient by ``torch.autograd.grad``, then a step on the perturbed input),
    ``"penalty"`` (``create_graph=True`` between the forward and ``engine.backward``, the penalty trained through),
    ``"param_penalty"`` (the same of the gradients of the first block's parameters),
    ``"inside_create_graph"`` / ``"inside_detached"`` / ``"inside_retry"`` (the penalty inside the model's forward),
    ``"raises"`` (in the first step, the input's gradient by a pass that raises midway, caught; ``""``: none),
    ``"raises_then_retry"`` (that in every step, then ``"penalty"``'s). Returns the losses,
    the full state dict and, at stage 3, the units gathered right after each ``torch.autograd.grad`` outside a
    forward, and after each step, and at stage 3 the outer units' learned schedule (``(scheduled, tail)``)."""
    torch.manual_seed(0)
    inside = pattern.removeprefix("inside_") if pattern.startswith("inside_") else ""
    extra = {} if keep is None or stage != 3 else {"keep_root_bytes": keep}
    engine = initialize(Net(inside), optimizer="AdamW", optimizer_kwargs={"lr": 1e-2},
                        config=ZeroConfig(stage=stage, units=units if stage == 3 else (), grad_accum_steps=accum,
                                          **extra))
    gathered = lambda: sorted(u.name or "<root>" for u in getattr(engine, "units", [])  # noqa: E731
                              if u.state is not UnitState.FREE and not u.persistent)
    losses, after_grad, after_step = [], [], []
    for step in range(steps):
        for micro in range(accum):
            x, y = _batch(step, micro)
            loss, logits = engine(x, y)
            if pattern == "fgsm":
                gx, = torch.autograd.grad(loss, x)
                after_grad.append(gathered())
                loss, _ = engine((x + 0.1 * gx.sign()).detach(), y)
            elif pattern == "penalty":
                gx, = torch.autograd.grad(logits.square().sum(), x, create_graph=True)
                after_grad.append(gathered())
                loss = loss + 0.1 * gx.square().mean()
            elif pattern == "raises" and step == 0:  # the input's gradient, whose pass raises midway (a hook's check)
                _try_raising(logits, x)
            elif pattern == "raises_then_retry":  # then the same again with a graph, a penalty trained through
                _try_raising(logits, x)
                gx, = torch.autograd.grad(logits.square().sum(), x, create_graph=True)
                loss = loss + 0.1 * gx.square().mean()
            elif pattern == "param_penalty":  # a gradient-norm penalty on the first block's parameters
                gp = torch.autograd.grad(loss, list(engine.module.blocks[0].parameters()), create_graph=True)
                loss = loss + 0.1 * sum(g.square().sum() for g in gp)
            engine.backward(loss)
            losses.append(loss.item())
        engine.step()
        after_step.append(gathered())
    every = sorted(u.name or "<root>" for u in getattr(engine, "units", []) if not u.persistent)
    rec = engine.sched.outer.rec if stage == 3 else {}  # Note [Outer units]: what the first step learned
    return {"losses": losses, "state": engine.full_state_dict(rank0_only=False), "after_grad": after_grad,
            "after_step": after_step, "every": every,
            "schedule": {u.name: (r.scheduled, r.tail) for u, r in rec.items()}}


def _raise(grad: torch.Tensor) -> None:
    raise ValueError("a check in the input gradient's pass failed")


def _try_raising(out: torch.Tensor, x: torch.Tensor) -> None:
    """``torch.autograd.grad`` of ``out`` to ``x`` whose pass raises midway (a hook's check on ``out``), caught."""
    handle = out.register_hook(_raise)
    try:
        torch.autograd.grad(out.square().sum(), x, retain_graph=True)
    except ValueError:
        pass
    handle.remove()
