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


def train_steps(engine, steps: int, width: int, prepare=lambda step, rank: None, rows: int = 4,
                seed_step: int = 10) -> list[float]:
    """``steps`` optimizer steps of ``engine`` on this rank's batches of ``rows`` x ``width`` (seeded by
    ``seed_step * step + rank``), calling ``prepare(step, rank)`` before each; the losses."""
    losses = []
    for step in range(steps):
        prepare(step, dist.get_rank())
        x = torch.randn(rows, width, generator=torch.Generator().manual_seed(seed_step * step + dist.get_rank()))
        loss = engine(x)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return losses


def same_batch_steps(engine, x: torch.Tensor, steps: int) -> list[float]:
    """``steps`` optimizer steps of ``engine`` on the same batch ``x``; the losses."""
    losses = []
    for _ in range(steps):
        loss = engine(x)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return losses


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
    check = engine.check_parameters  # the engine's own check of the model's parameters, every forward

    def checking():
        inside["on"] = True
        try:
            check()
        finally:
            inside["on"] = False

    engine.check_parameters = checking
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


def collectives_per_gather() -> dict:
    """AdamW with weight decay: each ``Block`` unit holds two flat buffers (matrices; biases and norms). In a
    steady step: the all-gather collectives issued (a coalesced one counts once), the units gathered, and the
    gradients' reduce-scatter collectives (Note [One reduce-scatter per launch])."""
    from zerorun.zero.comm import Comm
    from zerorun.zero.stage3_checks import GatherDigest

    torch.manual_seed(0)
    model = Net()
    engine = initialize(model, optimizer="AdamW", optimizer_kwargs={"lr": 1e-3, "weight_decay": 0.1},
                        config=ZeroConfig(stage=3, units=("Block",)))
    got = {"collectives": 0, "gathers": 0, "inside": False, "reduce_scatters": 0}
    single, coalesced, values = Comm.all_gather, Comm.all_gather_coalesced, GatherDigest.values
    reduce_scatter = Comm.reduce_scatter_coalesced  # every reduce-scatter of the gradients goes through it

    def scatter(self, *args):
        got["reduce_scatters"] += 1
        return reduce_scatter(self, *args)

    def one(self, *args):
        got["collectives"] += 0 if got["inside"] else 1
        return single(self, *args)

    def many(self, *args):
        got["collectives"] += 1
        got["inside"] = True
        try:
            return coalesced(self, *args)
        finally:
            got["inside"] = False

    def digest(self):
        got["gathers"] = len(self.engine.gathering.log)  # the units gathered since the last step
        return values(self)

    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(dist.get_rank()))
    engine.backward(engine(x))
    engine.step()
    Comm.all_gather, Comm.all_gather_coalesced, GatherDigest.values = one, many, digest
    Comm.reduce_scatter_coalesced = scatter
    try:
        engine.backward(engine(x))
        engine.step()
    finally:
        Comm.all_gather, Comm.all_gather_coalesced, GatherDigest.values = single, coalesced, values
        Comm.reduce_scatter_coalesced = reduce_scatter
    return {"buffers": [len(u.buffers) for u in engine.units if u.name.startswith("blocks")],
            "collectives": got["collectives"], "gathers": got["gathers"], "reduce_scatters": got["reduce_scatters"],
            "units_with_gradients": sum(bool(u.trainable) for u in engine.units)}


class Reordered(Net):
    """:class:`Net` whose rank 1 runs its blocks in reverse from step ``swap_from`` on (same shapes)."""

    swap = False

    def forward(self, x):
        for b in (self.blocks[::-1] if self.swap and dist.get_rank() == 1 else self.blocks):
            x = b(x)
        return self.head(x).pow(2).mean()


def reordered_after_first_step(steps: int = 3) -> str:
    """Train :class:`Reordered` at stage 3 (prefetch on, the default) with rank 1 reversing its blocks from the
    second step on; the error raised, or ``""``."""
    torch.manual_seed(0)
    model = Reordered()
    engine = initialize(model, optimizer="SGD", optimizer_kwargs={"lr": 0.1},
                        config=ZeroConfig(stage=3, units=("Block",)))
    try:
        for step in range(steps):
            model.swap = step >= 1
            x = torch.randn(4, 16, generator=torch.Generator().manual_seed(10 * step + dist.get_rank()))
            engine.backward(engine(x))
            engine.step()
    except RuntimeError as e:
        return str(e)
    return ""


def reordered_evaluation() -> dict:
    """:class:`Reordered` at stage 3 evaluated (forwards without gradients, no backward ever): first in the same
    order on every rank (the losses), then with rank 1 reversing its blocks (the error raised, or ``""``)."""
    torch.manual_seed(0)
    model = Reordered()
    engine = initialize(model, optimizer="SGD", optimizer_kwargs={"lr": 0.1},
                        config=ZeroConfig(stage=3, units=("Block",)))
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(dist.get_rank()))
    with torch.no_grad():
        same = [float(engine(x)) for _ in range(2)]
        model.swap = True
        try:
            engine(x)
            error = ""
        except RuntimeError as e:
            error = str(e)
    return {"same": same, "error": error}


def units_by_name(units: tuple, stage: int = 3, steps: int = 3, tie: bool = False, **zero) -> dict:
    """Train ``Net`` with ``zero.units`` ``units`` (class or module names) and the other ``zero`` settings at
    ``stage`` (``tie``: blocks 0 and 1 share one ``fc``): per-step losses, the units and their roles, and the
    run's description of them (``engine.describe_units()``, the lines ``zerorun train`` prints)."""
    torch.manual_seed(0)
    model = Net()
    if tie:
        model.blocks[1].fc = model.blocks[0].fc
    engine = initialize(model, optimizer="AdamW", optimizer_kwargs={"lr": 1e-2},
                        config=ZeroConfig(stage=stage, units=units if stage == 3 else (), **zero))
    losses = same_batch_steps(engine, torch.randn(4, 16, generator=torch.Generator().manual_seed(dist.get_rank())),
                              steps)
    roles = {u.name: "outer" if u.outer else "root" if u.is_root else "listed" for u in getattr(engine, "units", [])
             if not u.persistent}
    lines = engine.describe_units() if stage == 3 else []
    return {"losses": losses, "roles": roles, "lines": lines}


class Borrower(nn.Module):
    """A block whose forward reads another module's weight (``borrow``, tied by attribute) before or after its
    own."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.borrow: list[nn.Module] = []
        self.first = True
        self.fail = False

    def forward(self, x):
        if self.fail:
            raise ValueError("bad batch")
        if self.borrow and self.first:
            x = x + 0.1 * torch.nn.functional.linear(x, self.borrow[0].weight)
        x = x + torch.tanh(self.fc(x))
        if self.borrow and not self.first:
            x = x + 0.1 * torch.nn.functional.linear(x, self.borrow[0].weight)
        return x


class BorrowNet(nn.Module):
    def __init__(self, first: bool, emb: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 16) if emb else None
        self.blocks = nn.ModuleList(Borrower() for _ in range(3))
        self.blocks[1].borrow.append(self.emb if emb else self.blocks[0].fc)  # a weight it reads, not a submodule
        self.blocks[1].first = first
        self.norm, self.head = nn.LayerNorm(16), nn.Linear(16, 1)

    def forward(self, x):
        if self.emb is not None:
            x = x + self.emb(torch.arange(x.shape[0]) % 16)
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x)).pow(2).mean()


def borrow(stage: int, first: bool = True, compile_backend: str = "", emb: bool = False, steps: int = 3) -> dict:
    """Train ``BorrowNet`` at ``stage``: per-step losses; at stage 3 the units each unit gathers with itself
    (Note [External parameters]), which outer units stayed tails (``zero.keep_root_bytes`` 0: else the small
    root and outer units are kept from forward to backward and no tail is deferred), and the stage-3 warnings."""
    import warnings

    torch.manual_seed(0)
    model = BorrowNet(first, emb)
    if compile_backend:
        model = torch.compile(model, backend=compile_backend)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = initialize(model, optimizer="SGD", optimizer_kwargs={"lr": 0.1},
                            config=ZeroConfig(stage=stage, units=("Borrower",) if stage == 3 else (),
                                              keep_root_bytes=0))
        losses = train_steps(engine, steps, width=16)
    units = getattr(engine, "units", [])
    return {"losses": losses, "external": {u.name: sorted(o.name for o in u.external) for u in units if u.external},
            "tails": sorted(u.name for u in engine.sched.outer.tails()) if units else [],
            "warnings": sorted({str(w.message)[:80] for w in caught if "stage 3" in str(w.message)})}


def read_after_failed_forward() -> dict:
    """A forward that raises inside a unit (caught; training goes on), then a read of a parameter between
    steps on rank 0 only: refused as at rest, and the next step trains on every rank."""
    torch.manual_seed(0)
    model = BorrowNet(first=True)
    engine = initialize(model, optimizer="SGD", optimizer_kwargs={"lr": 0.1},
                        config=ZeroConfig(stage=3, units=("Borrower",)))
    x = torch.randn(4, 16)
    engine.backward(engine(x))
    engine.step()
    model.blocks[2].fail = True
    try:
        engine(x)
    except ValueError:
        pass
    model.blocks[2].fail = False
    refused = ""
    if dist.get_rank() == 0:
        try:
            model.blocks[0].fc.weight.norm()
        except RuntimeError as e:
            refused = str(e)
    engine.backward(engine(x))
    engine.step()
    return {"refused": refused, "external": {u.name: [o.name for o in u.external] for u in engine.units if u.external}}


class Expert(nn.Module):
    def __init__(self, d: int, h: int, bias: bool = True) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, h, bias=bias), nn.Linear(h, d, bias=bias)

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


class BigExpert(Expert):
    """Another class in the same ModuleList (a larger variant)."""


class MoE(nn.Module):
    """Two experts of different sizes in one ModuleList; ``route``: ``rank`` (each rank runs its own one) or
    ``all`` (every rank runs both)."""

    def __init__(self, case: str, route: str) -> None:
        super().__init__()
        small, big = (Expert(16, 32, bias=case != "bias"),
                      (BigExpert if case == "subclass" else Expert)(16, 64))
        if case == "frozen":
            small.fc1.requires_grad_(False)
        self.route = route
        pair = [big, small] if case == "reversed" else [small, big]  # reversed: the last one, kept, is padded
        self.inp, self.experts, self.head = nn.Linear(8, 16), nn.ModuleList(pair), nn.Linear(16, 1)

    def forward(self, x):
        h = self.inp(x)
        chosen = [self.experts[dist.get_rank() % 2]] if self.route == "rank" else list(self.experts)
        for e in chosen:
            h = h + e(h)
        return self.head(h).pow(2).mean()


def experts(case: str, route: str, stage: int = 3, steps: int = 3) -> dict:
    """Train ``MoE(case, route)`` at ``stage`` (``case``: basic, bias, bucket, persist, subclass, frozen, reversed
    (the big expert first); see Note [Peer units]): per-step losses, or the error; the parameter bytes this rank
    holds at rest."""
    torch.manual_seed(0)
    config = {"bucket": {"bucket_mb": 0.002}, "persist": {"persistence_threshold": 32}}.get(case, {})
    units = ("experts.0", "experts.1") if stage == 3 else ()  # by name: whatever their classes
    try:
        engine = initialize(MoE(case, route), optimizer="SGD", optimizer_kwargs={"lr": 0.1},
                            config=ZeroConfig(stage=stage, units=units, **config))
        losses = train_steps(engine, steps, width=8)
    except RuntimeError as e:
        return {"error": str(e)}
    return {"losses": losses, "param_bytes": engine.memory_bytes()["params"],
            "gather_bytes": {u.name: u.gather_bytes for u in getattr(engine, "units", []) if u.gather_bytes}}


def experts_traffic(case: str) -> dict:
    """``MoE(case, "all")`` at stage 3, every rank running both experts (of different layouts: Note [Peer units]):
    the bytes this rank sent in its second step (zero/comm.py's count), and whether the experts were padded."""
    torch.manual_seed(0)
    config = {"bucket": {"bucket_mb": 0.002}, "persist": {"persistence_threshold": 32}}.get(case, {})
    engine = initialize(MoE(case, "all"), optimizer="SGD", optimizer_kwargs={"lr": 0.1},
                        config=ZeroConfig(stage=3, units=("experts.0", "experts.1"), **config))
    train_steps(engine, 1, width=8)
    sent = engine.comm_stats()["bytes_sent"]
    train_steps(engine, 1, width=8)
    return {"sent": engine.comm_stats()["bytes_sent"] - sent, "padded": any(u.gather_bytes for u in engine.units)}


def trims_before_backward(stage: int, steps: int = 3) -> int:
    """How many times ``Net`` trained ``steps`` steps at ``stage`` (on CPU) asked for glibc's heap to be trimmed
    (``allocator.trim_dynamic``: Note [Trimmed before backward] in zerorun/zero/allocator.py)."""
    from zerorun.zero import allocator

    calls = []
    real = allocator.trim_dynamic
    allocator.trim_dynamic = lambda: calls.append(1) or real()
    try:
        torch.manual_seed(0)
        engine = initialize(Net(), optimizer="SGD", optimizer_kwargs={"lr": 0.1},
                            config=ZeroConfig(stage=stage, units=("Block",) if stage == 3 else ()))
        train_steps(engine, steps, 16)
    finally:
        allocator.trim_dynamic = real
    return len(calls)


class Branchy(nn.Module):
    """A review's model: a trunk, then one of two heads of different sizes, chosen by the data (each rank of a
    2-rank job takes another), and a module never called; no container, so no automatic listed unit."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk, self.never = nn.Linear(8, 8), nn.Linear(8, 8)
        self.left, self.right = nn.Linear(8, 1), nn.Linear(8, 3)

    def forward(self, x):
        h = torch.relu(self.trunk(x))
        return (self.left(h) if float(x.sum()) > 0 else self.right(h)).pow(2).mean()


def branchy(stage: int, steps: int = 4) -> dict:
    """Per-step losses of :class:`Branchy` at ``stage`` with automatic units (rank 0 takes the left head), and
    what the run says of its units."""
    torch.manual_seed(0)
    engine = initialize(Branchy(), optimizer="AdamW", optimizer_kwargs={"lr": 1e-2},
                        config=ZeroConfig(stage=stage))
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1)).abs() * (1 if dist.get_rank() == 0 else -1)
    return {"losses": same_batch_steps(engine, x, steps), "lines": engine.describe_units() if stage == 3 else []}
