"""Cases run on every rank of a gloo group by tests/test_stage3_units.py: stage 3's units as objects (what a
unit's parameters are while gathered and at rest, its all-gathers, units of different sizes)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from zerorun.zero import ZeroConfig, initialize


class Block(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.fc, self.norm = nn.Linear(d, d), nn.LayerNorm(d)

    def forward(self, x):
        return self.norm(torch.relu(self.fc(x))) + x


class Net(nn.Module):
    def __init__(self, n: int = 3, d: int = 16) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x).pow(2).mean()


def parameter_classes() -> dict:
    """The Python class of a block's parameters inside its forward (gathered) and between steps (at rest), and
    the guard's calls made while the blocks compute (Note [Plain while gathered] in stage3_access.py)."""
    from zerorun.zero import stage3_access

    torch.manual_seed(0)
    model = Net()
    engine = initialize(model, optimizer="SGD", optimizer_kwargs={"lr": 0.1}, config=ZeroConfig(stage=3, units=("Block",)))
    seen = {"inside": set(), "guard_calls_in_blocks": 0}
    inside = {"on": False}
    guard = stage3_access.ZeroParameter.__torch_function__.__func__

    def counting(cls, func, types, args=(), kwargs=None):
        if inside["on"]:
            seen["guard_calls_in_blocks"] += 1
        return guard(cls, func, types, args, kwargs)

    def pre(module, args):
        inside["on"] = True
        seen["inside"] |= {type(p).__name__ for p in module.parameters()}

    def post(module, args, out):
        inside["on"] = False

    for b in model.blocks:
        b.register_forward_pre_hook(pre)
        b.register_forward_hook(post)
    stage3_access.ZeroParameter.__torch_function__ = classmethod(counting)
    try:
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(dist.get_rank()))
        for _ in range(2):
            engine.backward(engine(x))
            engine.step()
    finally:
        stage3_access.ZeroParameter.__torch_function__ = classmethod(guard)
    rest = {type(p).__name__ for p in model.blocks[0].parameters()}
    try:
        model.blocks[0].fc.weight.sum()
        refused = ""
    except RuntimeError as e:
        refused = str(e)
    return {"inside": sorted(seen["inside"]), "rest": sorted(rest), "guard_calls": seen["guard_calls_in_blocks"],
            "refused": refused}


def units_by_name(units: tuple, stage: int = 3, steps: int = 3) -> dict:
    """Train ``Net`` with ``zero.units`` ``units`` (class or module names) at ``stage``: per-step losses, the
    units and their roles, and the run's description of them (zerorun.zero.units.describe_units)."""
    from zerorun.zero.unit_plan import describe_units

    torch.manual_seed(0)
    model = Net()
    engine = initialize(model, optimizer="AdamW", optimizer_kwargs={"lr": 1e-2},
                        config=ZeroConfig(stage=stage, units=units if stage == 3 else ()))
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(dist.get_rank()))
    losses = []
    for _ in range(steps):
        loss = engine(x)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    roles = {u.name: "outer" if u.outer else "root" if u.is_root else "listed" for u in getattr(engine, "units", [])
             if not u.persistent}
    lines = describe_units(engine.units, engine.units_without_params) if stage == 3 else []
    return {"losses": losses, "roles": roles, "lines": lines}
