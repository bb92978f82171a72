"""Cases run on every rank of a gloo group by tests/test_activation_checkpointing.py (Note [Recomputed as first
run] in zerorun/zero/recompute.py): stage 3 with ``activation_checkpointing`` against stage 0 without it."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from zerorun.zero import ZeroConfig, initialize


class Block(nn.Module):
    """``kind``: ``"bn"`` (BatchNorm: running statistics updated in forward), ``"gate"`` (a buffer read, then
    halved in place under ``no_grad``), ``"count"`` (a buffer replaced by a new tensor each call, then read),
    ``"dropout"`` (the recomputation must draw the same mask)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.fc1, self.fc2 = nn.Linear(12, 15, bias=kind != "bn"), nn.Linear(15, 12)
        self.bn = nn.BatchNorm1d(15) if kind == "bn" else None
        self.register_buffer("gate", torch.ones(12), persistent=False)
        self.register_buffer("count", torch.zeros(()))

    def forward(self, h):
        z = self.fc1(h)
        z = torch.tanh(self.bn(z) if self.bn is not None else z)
        if self.kind == "dropout":
            z = F.dropout(z, 0.3, self.training)
        y = self.fc2(z)
        if self.kind == "gate":
            y = y * self.gate.clone()
            with torch.no_grad():
                self.gate.mul_(0.5)
        if self.kind == "count":
            self.count = self.count + 1
            y = y * (1 + 0.1 * self.count)
        return h + y


class Net(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.inp, self.head = nn.Linear(7, 12), nn.Linear(12, 5)
        self.blocks = nn.ModuleList(Block(kind) for _ in range(2))

    def forward(self, x, y):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return F.cross_entropy(self.head(h), y)


def train(stage: int, kind: str, accum: int = 1, forwards: int = 1, steps: int = 3) -> dict:
    """``steps`` optimizer steps of ``accum`` micro-steps; each micro-step's loss sums ``forwards`` forwards (a
    unit's calls recomputed in one backward, each with its own buffers). Stage 3 checkpoints every block. Returns
    the losses, the state dict and every buffer (non-persistent ones included), on this rank."""
    torch.manual_seed(0)
    engine = initialize(Net(kind), optimizer="AdamW", optimizer_kwargs={"lr": 1e-2},
                        config=ZeroConfig(stage=stage, units=("Block",) if stage == 3 else (), grad_accum_steps=accum,
                                          activation_checkpointing=stage == 3))
    losses = []
    for step in range(steps):
        for micro in range(accum):
            loss = 0
            for f in range(forwards):
                g = torch.Generator().manual_seed(1000 * step + 100 * micro + 10 * f + dist.get_rank())
                torch.manual_seed(1000 * step + 100 * micro + 10 * f)  # dropout's mask
                loss = loss + engine(torch.randn(6, 7, generator=g), torch.randint(0, 5, (6,), generator=g))
            engine.backward(loss)
            losses.append(loss.item())
        engine.step()
    buffers = {n: b.clone() for n, b in engine.module.named_buffers()}
    return {"losses": losses, "state": engine.full_state_dict(rank0_only=False), "buffers": buffers}
