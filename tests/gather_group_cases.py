"""Cases run on every rank of a gloo group by tests/test_stage3_units.py: the all-gathers that stage 3 issues
as one collective (Note [Units gathered together] in zerorun/zero/units.py) are grouped alike on every rank."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from zerorun.zero import ZeroConfig, initialize, register_external_parameter
from zerorun.zero.comm import Comm
from stage3_cases import Block


class Reader(Block):
    """A block that reads ``inner``'s weight (declared external, so ``inner`` is gathered with it) and, while
    ``extra`` is set, runs ``inner`` once more on a detached input: a call of a unit that is already gathered, which
    gathers nothing."""

    def __init__(self, inner: Block) -> None:
        super().__init__()
        self.__dict__["inner"] = inner  # not a submodule
        self.extra = False

    def forward(self, x):
        h = super().forward(x) + 0.0 * self.inner.fc.weight.sum()
        if self.extra:
            self.inner(h.detach())
        return h


class Big(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.fcs = nn.Sequential(*[nn.Linear(d, d) for _ in range(4)])

    def forward(self, x):
        return torch.tanh(self.fcs(x)) + x


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        first = Block()
        self.blocks_a = nn.ModuleList([first, Reader(first)])
        self.big = Big()
        self.blocks_b = nn.ModuleList(Block() for _ in range(6))
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        for b in [*self.blocks_a, self.big, *self.blocks_b]:
            x = b(x)
        return self.head(x).pow(2).mean()


def extra_call_on_one_rank(stage: int, steps: int = 3) -> dict:
    """Train :class:`Net` (units ``Block``, ``Reader``, ``Big``; ``prefetch_bytes`` the size of ``Big`` and one
    block) with rank 0's ``Reader`` calling its gathered inner block again in the first step only. The losses,
    and the bytes of each all-gather this rank issued (one list entry per collective)."""
    torch.manual_seed(0)
    model = Net()
    config = ZeroConfig(stage=stage)
    if stage == 3:
        register_external_parameter(model.blocks_a[1], model.blocks_a[0].fc.weight)
        config = ZeroConfig(stage=3, units=("Block", "Reader", "Big"), prefetch_bytes=4352 + 1216)
    engine = initialize(model, optimizer="SGD", optimizer_kwargs={"lr": 0.1}, config=config)
    sizes, losses, gather = [], [], Comm.all_gather_coalesced

    def counted(self, outputs, inputs, message_bytes=0):
        sizes.append(max(message_bytes, sum(i.nbytes for i in inputs)))
        return gather(self, outputs, inputs, message_bytes)

    Comm.all_gather_coalesced = counted
    try:
        for step in range(steps):
            model.blocks_a[1].extra = step == 0 and dist.get_rank() == 0
            x = torch.randn(4, 16, generator=torch.Generator().manual_seed(10 * step + dist.get_rank()))
            loss = engine(x)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
    finally:
        Comm.all_gather_coalesced = gather
    return {"losses": losses, "gathers": sizes}


class Shared(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x, use: bool = True):
        return x + torch.tanh(self.fc(x)) if use else x * 1.0


class SharedTwice(nn.Module):
    """``s`` is called before the blocks and after them (weight sharing); ``use_first`` False: its first call
    reads none of its parameters."""

    def __init__(self, raw: bool = False) -> None:
        super().__init__()
        self.inp, self.s = nn.Linear(16, 16), Shared()
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(16, 1)
        self.use_first, self.raw = True, raw  # raw: the first call takes the input itself (no gradient)

    def forward(self, x):
        x = self.s(x if self.raw else self.inp(x), use=self.use_first)
        for b in self.blocks:
            x = b(x)
        return self.head(self.s(x)).pow(2).mean()


def first_call_idle_on_one_rank(stage: int, steps: int = 4) -> list[float]:
    """Train :class:`SharedTwice` (units ``Shared`` and ``Block``) with rank 0's first call of ``s`` reading none
    of its parameters from the second step on; the losses."""
    torch.manual_seed(0)
    model = SharedTwice()
    config = ZeroConfig(stage=3, units=("Shared", "Block")) if stage == 3 else ZeroConfig(stage=stage)
    engine = initialize(model, optimizer="SGD", optimizer_kwargs={"lr": 0.1}, config=config)
    losses = []
    for step in range(steps):
        model.use_first = not (step >= 1 and dist.get_rank() == 0)
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(100 * step + dist.get_rank()))
        loss = engine(x)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return losses


def first_call_on_the_input_some_steps(stage: int, steps: int = 4, prefetch_bytes: int | None = None) -> list[float]:
    """Train :class:`SharedTwice` (units ``Shared`` and ``Block``) with ``s`` first called on the input itself,
    reading its parameters on rank 0 in even steps only (on rank 1 never): a backward that reaches ``s`` twice on
    rank 0, in some steps, and once elsewhere. The losses."""
    torch.manual_seed(0)
    model = SharedTwice(raw=True)
    config = ZeroConfig(stage=stage)
    if stage == 3:
        config = ZeroConfig(stage=3, units=("Shared", "Block"), prefetch_bytes=prefetch_bytes)
    engine = initialize(model, optimizer="SGD", optimizer_kwargs={"lr": 0.1}, config=config)
    losses = []
    for step in range(steps):
        model.use_first = dist.get_rank() == 0 and step % 2 == 0
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(100 * step + dist.get_rank()))
        loss = engine(x)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return losses


class Expert(nn.Module):
    def __init__(self, width: int, d: int = 16) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, width), nn.Linear(width, d)

    def forward(self, x):
        if x.shape[0] == 0:
            return x * 1.0  # no token here: it runs, on an empty batch, and reads none of its parameters
        return self.fc2(torch.relu(self.fc1(x)))


class MoELayer(nn.Module):
    def __init__(self, widths, d: int = 16) -> None:
        super().__init__()
        self.gate = nn.Linear(d, len(widths))
        self.experts = nn.ModuleList(Expert(w, d) for w in widths)

    def forward(self, x):
        choice = self.gate(x).argmax(-1)
        out = x.clone()
        for i, expert in enumerate(self.experts):
            idx = (choice == i).nonzero().flatten()
            out = out.index_add(0, idx, expert(x[idx]))
        return out


class SharedMoE(nn.Module):
    """Three MoE layers of experts of widths 8, 24, 40 (the peers of Note [Peer units]); layer 0 runs again after
    the others (weight sharing). Each rank routes its own tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(MoELayer((8, 24, 40)) for _ in range(3))
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        for layer in [*self.layers, self.layers[0]]:
            x = layer(x) + x
        return self.head(x).pow(2).mean()


def shared_moe_routed_per_rank(prefetch_bytes: int | None, steps: int = 5) -> str:
    """Train :class:`SharedMoE` at stage 3 (units ``Expert``); the error raised on this rank, or ``""``."""
    torch.manual_seed(0)
    config = ZeroConfig(stage=3, units=("Expert",), prefetch_bytes=prefetch_bytes)
    engine = initialize(SharedMoE(), optimizer="SGD", optimizer_kwargs={"lr": 0.002}, config=config)
    try:
        for step in range(steps):
            x = torch.randn(3, 16, generator=torch.Generator().manual_seed(100 * step + dist.get_rank()))
            loss = engine(x)
            engine.backward(loss)
            engine.step()
    except RuntimeError as e:
        return str(e)
    return ""
