"""Cases run on every rank of a gloo group by tests/test_stage3_units.py: the all-gathers that stage 3 issues
as one collective (Note [Units gathered together] in zerorun/zero/units.py) are grouped alike on every rank."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from zerorun.zero import ZeroConfig, initialize, register_external_parameter
from zerorun.zero.comm import Comm
from stage3_cases import Block, train_steps


def train(model: nn.Module, stage: int, units: tuple, steps: int, prepare=lambda step, rank: None, rows: int = 4,
          seed_step: int = 100, lr: float = 0.1, **zero) -> list[float]:
    """Train ``model`` with SGD at ``stage`` (stage 3: ``units`` and the ``zero`` settings) for ``steps`` steps of
    ``stage3_cases.train_steps``; the losses."""
    config = ZeroConfig(stage=3, units=units, **zero) if stage == 3 else ZeroConfig(stage=stage)
    engine = initialize(model, optimizer="SGD", optimizer_kwargs={"lr": lr}, config=config)
    return train_steps(engine, steps, 16, prepare, rows, seed_step)


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

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.s = nn.Linear(16, 16), Shared()
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(16, 1)
        self.use_first = True

    def forward(self, x):
        x = self.s(self.inp(x), use=self.use_first)
        for b in self.blocks:
            x = b(x)
        return self.head(self.s(x)).pow(2).mean()


def first_call_idle_on_one_rank(stage: int, steps: int = 4) -> list[float]:
    """Train :class:`SharedTwice` (units ``Shared`` and ``Block``) with rank 0's first call of ``s`` reading none
    of its parameters from the second step on; the losses."""
    torch.manual_seed(0)
    model = SharedTwice()

    def prepare(step: int, rank: int) -> None:
        model.use_first = not (step >= 1 and rank == 0)

    return train(model, stage, ("Shared", "Block"), steps, prepare)


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


def shared_moe_routed_per_rank(stage: int, prefetch_bytes: int | None = None, steps: int = 5) -> list[float]:
    """Train :class:`SharedMoE` (stage 3: units ``Expert``); the losses."""
    torch.manual_seed(0)
    return train(SharedMoE(), stage, ("Expert",), steps, rows=3, lr=0.002, prefetch_bytes=prefetch_bytes)


class Gained(nn.Module):
    """``mode``: what its forward reads: ``"fc"`` its own parameters, ``"id"`` none (``x * 1.0``: an expert without
    tokens), ``"gain"`` ``gain``, a parameter of another unit (the root's)."""

    def __init__(self, gain: nn.Parameter, d: int = 16) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.__dict__["gain"] = gain  # not a parameter of this module

    def forward(self, x, mode: str = "fc"):
        return {"fc": lambda: x + torch.tanh(self.fc(x)), "id": lambda: x * 1.0, "gain": lambda: x * self.gain}[mode]()


class OnTheInput(nn.Module):
    """``s`` is called on the input itself, then after a block, in the ``modes`` of :class:`Gained`."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, 16))
        self.s, self.block, self.head = Gained(self.gain), Block(), nn.Linear(16, 1)
        self.modes = ("fc", "fc")

    def forward(self, x):
        x = self.s(x, self.modes[0])
        return self.head(self.s(self.block(x), self.modes[1])).pow(2).mean()


def unit_called_on_the_input(stage: int, pattern: str, prefetch_bytes: int | None = None, steps: int = 3) -> list:
    """Train :class:`OnTheInput` (stage 3: units ``Gained`` and ``Block``); the losses. ``pattern``:
    ``"unused-last-step"``: rank 0 reads none of ``s``'s parameters in the first step (both calls ``"id"``);
    ``"other-units-parameter"``: the first call reads ``s``'s own parameters on rank 0, the root's on the others."""
    torch.manual_seed(0)
    model = OnTheInput()

    def prepare(step: int, rank: int) -> None:
        if pattern == "unused-last-step":
            model.modes = ("id", "id") if step == 0 and rank == 0 else ("fc", "fc")
        else:
            model.modes = ("fc" if rank == 0 else "gain", "fc")

    return train(model, stage, ("Gained", "Block"), steps, prepare, seed_step=10, prefetch_bytes=prefetch_bytes)



class BesideTheInput(nn.Module):
    """``d`` and then ``s`` run on the input itself, ``block`` on their sum, ``s`` again after it: backward reaches
    ``s`` twice on a rank where its first call reads its parameters, and ``d`` after that."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(16))
        self.d, self.s, self.block, self.head = Block(), Gained(self.gain), Block(), nn.Linear(16, 1)
        self.first = "fc"

    def forward(self, x):
        d = self.d(x)
        h = self.block(self.s(x, self.first) + d)
        return self.head(self.s(h)).pow(2).mean()


def second_backward_on_one_rank(stage: int, steps: int = 3) -> list[float]:
    """Train :class:`BesideTheInput` (stage 3: units ``Gained`` and ``Block``, ``prefetch_bytes`` two blocks'
    worth), ``s``'s first call reading its parameters on rank 0 only; the losses."""
    torch.manual_seed(0)
    model = BesideTheInput()

    def prepare(step: int, rank: int) -> None:
        model.first = "fc" if rank == 0 else "id"

    return train(model, stage, ("Gained", "Block"), steps, prepare, seed_step=10, prefetch_bytes=2 * 1216 + 64)


class Reading(nn.Module):
    """Reads ``other``'s weight in its forward (declared: ``register_external_parameter``), ``detach``ed or not."""

    def __init__(self, other: nn.Module, d: int = 16, detach: bool = False) -> None:
        super().__init__()
        self.fc, self.detach = nn.Linear(d, d), detach
        self.__dict__["other"] = other  # not a submodule
        register_external_parameter(self, other.fc.weight)

    def forward(self, x):
        weight = self.other.fc.weight.detach() if self.detach else self.other.fc.weight
        return x + torch.tanh(self.fc(x)) + 0.01 * (x @ weight)


class MaskedInput(nn.Module):
    """``s`` takes the input itself, with a learned mask token written into row 1 on rank 1 only (a BERT-style
    mask where the batch has masked rows): its input needs a gradient on some ranks only."""

    def __init__(self) -> None:
        super().__init__()
        self.scale, self.mask_token = nn.Parameter(torch.ones(16)), nn.Parameter(torch.linspace(-0.1, 0.1, 16))
        self.e, self.block, self.head = Block(), Block(), nn.Linear(16, 1)
        self.s = Reading(self.e)

    def forward(self, x):
        e = self.e(x * self.scale)
        if dist.get_rank() == 1:
            x = x.clone()
            x[1] = self.mask_token
        return self.head(self.block(self.s(x) + e)).pow(2).mean()


def input_needs_gradient_on_some_ranks(stage: int, steps: int = 3) -> list[float]:
    """Train :class:`MaskedInput` (stage 3: units ``Block`` and ``Reading``); the losses."""
    torch.manual_seed(0)
    return train(MaskedInput(), stage, ("Block", "Reading"), steps, seed_step=10)


class Masking(nn.Module):
    """Writes ``token`` into the ``rows`` of its input (none: the token goes unused)."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x, token, rows: list[int]):
        if rows:
            x = x.clone()
            x[rows] = token
        return x + torch.tanh(self.fc(x))


class UnusedTokenOnSomeRanks(nn.Module):
    """``s`` takes the input and a learned mask token on every rank, and uses the token on rank 1 only; ``r``,
    run before it, reads ``s``'s weight (declared, detached)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale, self.token = nn.Parameter(torch.ones(16)), nn.Parameter(torch.linspace(-0.1, 0.1, 16))
        self.s = Masking()
        self.r, self.block, self.head = Reading(self.s, detach=True), Block(), nn.Linear(16, 1)

    def forward(self, x):
        rows = [1] if dist.get_rank() == 1 else []
        return self.head(self.block(self.r(x * self.scale) + self.s(x, self.token, rows))).pow(2).mean()


def token_unused_on_some_ranks(stage: int, steps: int = 3) -> list[float]:
    """Train :class:`UnusedTokenOnSomeRanks` (stage 3: units ``Masking``, ``Reading``, ``Block``); the losses."""
    torch.manual_seed(0)
    return train(UnusedTokenOnSomeRanks(), stage, ("Masking", "Reading", "Block"), steps, seed_step=10, lr=0.02)


class LateNet(nn.Module):
    """Three Linears, each a unit; ``extra`` runs on rank 0 only: its forward all-gather has no partner."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.extra, self.b = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        x = self.a(x)
        if dist.get_rank() == 0:
            x = self.extra(x)
        return self.b(x).pow(2).mean()


class LoopNet(LateNet):
    """``b`` called once more on rank 1 than on rank 0 (a loop as long as each rank's own sequence): its second
    all-gather there has no partner (where ``b``, the last unit, is not kept from forward to backward)."""

    def forward(self, x):
        x = self.a(x)
        for _ in range(1 + dist.get_rank()):
            x = self.b(x)
        return x.pow(2).mean()


def unit_on_some_ranks(timeout_s: float, net: str = "late", keep: int | None = None) -> str:
    """One step of :class:`LateNet` (``net="loop"``: :class:`LoopNet`) at stage 3 over a gloo group whose
    collectives time out after ``timeout_s``; the error this rank raised. ``keep``: ``zero.keep_root_bytes``."""
    import datetime

    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
    torch.manual_seed(0)
    extra = {} if keep is None else {"keep_root_bytes": keep}
    engine = initialize({"late": LateNet, "loop": LoopNet}[net](), optimizer="SGD", optimizer_kwargs={"lr": 0.1},
                        process_group=group, config=ZeroConfig(stage=3, units=("Linear",), **extra))
    try:
        train_steps(engine, 1, 16)
    except RuntimeError as e:
        return str(e)
    return "no error"


class TimeoutNet(LateNet):
    """Raises the user's own error ``message`` (one that mentions a timeout or a closed connection) after ``a``,
    on every rank (with ``b``'s all-gather in flight: prefetched)."""

    message = ""

    def forward(self, x):
        self.a(x)
        raise RuntimeError(self.message)


def loop_net(stage: int, steps: int = 3) -> list[float]:
    """Train :class:`LoopNet` (stage 3: each Linear a unit, the default ``zero.keep_root_bytes``); the losses."""
    torch.manual_seed(0)
    engine = initialize(LoopNet(), optimizer="SGD", optimizer_kwargs={"lr": 0.1},
                        config=ZeroConfig(stage=stage, units=("Linear",) if stage == 3 else ()))
    return train_steps(engine, steps, 16)


def user_error_mentioning_a_timeout(message: str) -> str:
    """The error a stage-3 forward of :class:`TimeoutNet` raising ``message`` raises on this rank (twice: the
    second forward's, after the first step's schedule)."""
    torch.manual_seed(0)
    TimeoutNet.message = message
    engine = initialize(TimeoutNet(), optimizer="SGD", optimizer_kwargs={"lr": 0.1},
                        config=ZeroConfig(stage=3, units=("Linear",)))
    for _ in range(2):
        try:
            engine(torch.randn(4, 16))
        except RuntimeError as e:
            error = str(e)
    return error


def state_dict_on_rank0_only(timeout_s: float) -> str:
    """``if rank == 0: engine.state_dict()`` at stage 3 (local at stages 0-2) over a gloo group whose collectives
    time out after ``timeout_s``, the other rank going on to a barrier on that group: the error each rank raised."""
    import datetime

    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
    torch.manual_seed(0)
    engine = initialize(LateNet(), optimizer="SGD", optimizer_kwargs={"lr": 0.1}, process_group=group,
                        config=ZeroConfig(stage=3, units=("Linear",)))
    try:
        if dist.get_rank() == 0:
            engine.state_dict()
        dist.barrier(group)
    except RuntimeError as e:
        return str(e)
    return "no error"
