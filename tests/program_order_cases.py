"""Rank-side cases for tests/test_program_order.py (run by tests/distributed.py's RankPool).

Note [Testing program order]: NCCL pairs collectives by their order (Note [Program order] in zero/reducer.py), so
every rank must issue the same sequence whatever the timing. Gloo on CPU completes collectives fast and in
order, so timing alone hides a launch decided by ``is_completed()``; here every work handle answers "not yet"
at random until it is waited for (as NCCL's asynchronous completion may), and hooks sleep a random 0-2 ms,
different on each rank. Every collective the engine issues, over every :class:`Comm` (every group), is
recorded as ``(op, group, dtype, numel)``; the test requires the sequences of all ranks to be equal. The same
runs check that every tensor of a collective is on the group's device (tests/collective_devices.py).
"""

from __future__ import annotations

import contextlib
import random
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from collective_devices import COLLECTIVES, device_check
from zerorun.zero import ZeroConfig, initialize
from zerorun.zero.comm import Comm


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return x + torch.tanh(self.fc(self.norm(x)))


class SixBlocks(nn.Module):
    def __init__(self, width: int = 24) -> None:
        super().__init__()
        self.inp = nn.Linear(5, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(6))
        self.head = nn.Linear(width, 3)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h).square().mean()


class _Unsure:
    """A work handle whose ``is_completed()`` says "not yet" at random until it is waited for."""

    def __init__(self, work, rng: random.Random) -> None:
        self.work, self.rng, self.waited = work, rng, False

    def is_completed(self) -> bool:
        return self.waited or (self.rng.random() < 0.3 and self.work.is_completed())

    def wait(self) -> bool:
        self.waited = True
        return self.work.wait()


@contextlib.contextmanager
def recorded(rng: random.Random, log: list):
    """Record every collective of every :class:`Comm` into ``log``; wrap their handles in :class:`_Unsure`."""
    groups: dict = {}
    saved = {name: getattr(Comm, name) for name in COLLECTIVES}

    def wrap(name, method):
        def issue(self, tensor, *args, **kwargs):
            group = groups.setdefault(id(self.group), len(groups))
            many = list(tensor) if isinstance(tensor, (list, tuple)) else [tensor]  # a coalesced one: every tensor
            log.append((name, group, ",".join(str(t.dtype) for t in many), tuple(t.numel() for t in many)))
            return _Unsure(method(self, tensor, *args, **kwargs), rng)
        return issue

    for name, method in saved.items():
        setattr(Comm, name, wrap(name, method))
    try:
        yield
    finally:
        for name, method in saved.items():
            setattr(Comm, name, method)


def _delays(model: nn.Module, rng: random.Random) -> list:
    def nap(*_):
        time.sleep(rng.random() * 0.002)

    handles = []
    for block in model.blocks:
        handles.append(block.register_forward_pre_hook(lambda *a: nap()))
        handles.append(block.register_forward_hook(
            lambda m, a, out: out.register_hook(lambda g: nap()) and None))
    handles += [p.register_post_accumulate_grad_hook(nap) for p in model.parameters()]
    return handles


def sequences(combos: list[tuple[int, str]], steps: int = 3, accum: int = 2) -> dict:
    """For each ``(stage, precision)``: the collectives this rank issued over ``steps`` steps of ``accum``
    micro-steps of :class:`SixBlocks` (one 4 KiB bucket per weight or smaller: more buckets than
    ``MAX_INFLIGHT + 1``), each ``[op, group, dtype, numel]``. Raises ``AssertionError`` where a collective's
    tensor is off the group's device (collective_devices.py)."""
    rank = dist.get_rank()
    out = {}
    for stage, precision in combos:
        rng = random.Random(1000 * stage + rank)
        torch.manual_seed(0)
        model = SixBlocks()
        log: list = []
        with recorded(rng, log), device_check():  # Note [Checking devices on CPU] in collective_devices.py
            engine = initialize(model, optimizer="AdamW", optimizer_kwargs={"lr": 1e-2},
                                config=ZeroConfig(stage=stage, precision=precision, bucket_mb=0.002,
                                                  grad_accum_steps=accum, units=("Block",) if stage == 3 else ()))
            handles = _delays(model, rng)
            g = torch.Generator().manual_seed(rank)
            for _ in range(steps):
                for _ in range(accum):
                    engine.backward(engine(torch.randn(8, 5, generator=g)))
                engine.step()
        for h in handles:
            h.remove()
        out[f"{stage}/{precision}"] = log
    return out
