"""Cases run on every rank of a gloo group by tests/test_reducer.py (the gradient reducer, zero/reducer.py)."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from zerorun.zero import ZeroConfig, initialize


class Twice(nn.Module):
    """One Linear applied twice, each use inside a reentrant checkpoint: its gradient accumulates twice in one
    backward, from two graph tasks (the recomputations)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 1)

    def forward(self, x):
        h = checkpoint(self.a, x, use_reentrant=True)
        h = checkpoint(self.a, torch.tanh(h), use_reentrant=True)
        return self.b(h).square().mean()


class Stack(nn.Module):
    """``depth`` square Linears (one bucket each at ``bucket_mb = width**2 * 4 / 2**20``); ``reverse``: registered
    in the reverse of their use; ``unused``: one more, registered last, never used (e.g. a pooler)."""

    def __init__(self, width: int, depth: int, reverse: bool = False, unused: bool = False) -> None:
        super().__init__()
        layers = [nn.Linear(width, width, bias=False) for _ in range(depth)]
        self.layers = nn.ModuleList(layers[::-1] if reverse else layers)
        self.reverse = reverse
        self.unused = nn.Linear(width, width, bias=False) if unused else None

    def forward(self, x):
        for layer in (list(self.layers)[::-1] if self.reverse else self.layers):
            x = torch.tanh(layer(x))
        return x.square().mean()


def _params(engine, model) -> dict[str, torch.Tensor]:
    if engine.stage == 3:
        return {k: v.clone() for k, v in engine.full_state_dict(rank0_only=False).items()}
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _sgd_reference(model: nn.Module, batches: list, lr: float) -> list[dict[str, torch.Tensor]]:
    """Plain SGD on ``model`` with gradients all-reduced (mean) by hand, one batch per step: params after each step."""
    n = dist.get_world_size()
    out = []
    for x in batches:
        model.zero_grad()
        model(x).backward()
        with torch.no_grad():
            for p in model.parameters():
                g = p.grad if p.grad is not None else torch.zeros_like(p)
                dist.all_reduce(g)
                p -= lr * g / n
        out.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return out


def reentrant_twice(stage: int, steps: int = 3) -> dict:
    """Stage ``stage``, SGD lr 1 on :class:`Twice` against the hand-reduced reference: the largest absolute
    difference of the parameters after each step, and the reducer's second reductions (late gradients)."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Twice()
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(rank)
    batches = [torch.randn(4, 8, generator=g).requires_grad_(True) for _ in range(steps)]
    expected = _sgd_reference(ref, batches, 1.0)
    engine = initialize(model, optimizer="SGD", optimizer_kwargs={"lr": 1.0},
                        config=ZeroConfig(stage=stage, units=("Linear",) if stage == 3 else ()))
    diffs, fixups = [], []
    for x, want in zip(batches, expected):
        engine.backward(engine(x))
        engine.step()
        got = _params(engine, model)
        diffs.append(max(float((got[k] - want[k]).abs().max()) for k in want))
        fixups.append(engine.reducer.late_fixups)
    return {"diffs": diffs, "late_fixups": fixups}


def launch_order(stage: int, reverse: bool, unused: bool, steps: int = 3, width: int = 512, depth: int = 6) -> dict:
    """:class:`Stack` with one bucket per layer: the launch order rebuilt after step 1, how many launches
    happened inside backward (overlapped) in the last step, the most full bucket gradients held at once after
    step 1, and the parameters against the hand-reduced SGD reference."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Stack(width, depth, reverse, unused)
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(rank)
    batches = [torch.randn(16, width, generator=g) for _ in range(steps)]
    expected = _sgd_reference(ref, batches, 0.1)
    engine = initialize(model, optimizer="SGD", optimizer_kwargs={"lr": 0.1},
                        config=ZeroConfig(stage=stage, bucket_mb=width * width * 4 / 2**20,
                                          units=("Linear",) if stage == 3 else ()))
    reducer = engine.reducer
    names = {b: b.names[0] for b in reducer.buffers}
    state = {"in_backward": False, "inside": 0, "launches": 0, "ready": []}
    launch, ready = reducer._launch, reducer._bucket_ready

    def spy_launch(buf):
        state["launches"] += 1
        state["inside"] += state["in_backward"]
        launch(buf)

    def spy_ready(buf):
        if buf not in reducer._ready and state["in_backward"]:
            state["ready"].append(names[buf])
        ready(buf)

    begin, finish = reducer.begin, reducer.finish

    def spy_begin(**kw):
        state["in_backward"] = True
        begin(**kw)

    def spy_finish():
        state["in_backward"] = False
        finish()

    reducer._launch, reducer._bucket_ready, reducer.begin, reducer.finish = spy_launch, spy_ready, spy_begin, spy_finish
    diffs = []
    for step, (x, want) in enumerate(zip(batches, expected)):
        if step == steps - 1:
            state.update(inside=0, launches=0, ready=[])
            reducer.pool.max_taken = reducer.pool.taken
        engine.backward(engine(x))
        engine.step()
        got = _params(engine, model)
        diffs.append(max(float((got[k] - want[k]).abs().max()) for k in want))
    return {"order": [names[b] for b in reducer.order], "ready_in_backward": state["ready"],
            "launched_inside_backward": state["inside"], "launches": state["launches"],
            "max_full_grads": reducer.pool.max_taken, "cap": engine.MAX_INFLIGHT + 1, "diffs": diffs}


class Expert(nn.Module):
    def __init__(self, w: int) -> None:
        super().__init__()
        self.a, self.b, self.expert = nn.Linear(w, w), nn.Linear(w, w), nn.Linear(w, w)

    def forward(self, x, use_expert):
        h = torch.tanh(self.b(torch.tanh(self.a(x))))
        return h + self.expert(h) if use_expert else h


class Experts(nn.Module):
    def __init__(self, w: int = 32, depth: int = 6, reverse: bool = False, root_expert: bool = False) -> None:
        super().__init__()
        # in no unit (stage 3: the root's), used where the experts are
        self.root_expert = nn.Linear(w, w) if root_expert else None
        units = [Expert(w) for _ in range(depth)]
        self.units = nn.ModuleList(units[::-1] if reverse else units)
        self.reverse = reverse

    def forward(self, batch):
        x, use = batch
        if use and self.root_expert is not None:
            x = x + self.root_expert(x)
        for u in (list(self.units)[::-1] if self.reverse else self.units):
            x = u(x, use)
        return x.square().mean()


def expert_on_one_rank(stage: int, steps: int = 3, on_rank: int = 0, reverse: bool = False,
                       alternate: bool = False, root_expert: bool = False) -> list[float]:
    """Every unit runs on every rank, one Linear in each gets a gradient on rank ``on_rank`` only (an MoE expert
    no token reached on the others; ``alternate``: the rank changes every step), 1 KiB buckets: the grad norms
    of ``steps`` steps."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    engine = initialize(Experts(reverse=reverse, root_expert=root_expert), optimizer="SGD", optimizer_kwargs={"lr": 0.1},
                        config=ZeroConfig(stage=stage, bucket_mb=0.001, units=("Expert",) if stage == 3 else ()))
    x = torch.randn(4, 32)
    norms = []
    for step in range(steps):
        engine.backward(engine((x, rank == (on_rank + step * alternate) % dist.get_world_size())))
        norms.append(float(engine.step()))
    return norms


def stage_grads_after_backward(stage: int) -> dict:
    """What ``p.grad`` holds right after the last backward of a step (the reduced mean gradient at stage 0;
    ``None`` above) and after ``step`` (zeros)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    ref = copy.deepcopy(model)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    ref(x).square().mean().backward()
    for p in ref.parameters():
        dist.all_reduce(p.grad)
        p.grad /= n
    engine = initialize(model, optimizer="SGD", optimizer_kwargs={"lr": 0.1}, config=ZeroConfig(stage=stage))
    engine.backward(engine(x).square().mean())
    after_backward = [None if p.grad is None else float((p.grad - r.grad).abs().max())
                      for p, r in zip(model.parameters(), ref.parameters())]
    engine.step()
    after_step = [None if p.grad is None else float(p.grad.abs().max()) for p in model.parameters()]
    return {"after_backward": after_backward, "after_step": after_step}


class SideHead(nn.Module):
    """:class:`Experts` plus a unit ``side`` whose forward runs on every rank and whose output counts in the
    loss where ``use_side`` (an auxiliary head one rank skips)."""

    def __init__(self, w: int = 32) -> None:
        super().__init__()
        self.body, self.side = Experts(w, depth=2), Expert(w)

    def forward(self, batch):
        x, use_side, zero_side = batch
        loss = self.body((x, True))
        s = self.side(x, True).mean()
        return loss + s if use_side else (loss + 0.0 * s if zero_side else loss)


def side_head_on_one_rank(stage: int, zero_side: bool = False) -> tuple[str | None, list[float]]:
    """:class:`SideHead` whose ``side`` output counts on rank 1 only (``zero_side``: times 0.0 on rank 0):
    the error message (or ``None``) and the grad norms of two steps."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    engine = initialize(SideHead(), optimizer="SGD", optimizer_kwargs={"lr": 0.1},
                        config=ZeroConfig(stage=stage, bucket_mb=0.001, units=("Expert",) if stage == 3 else ()))
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(rank))
    norms = []
    try:
        for _ in range(2):
            engine.backward(engine((x, rank == 1, zero_side)))
            norms.append(float(engine.step()))
    except RuntimeError as e:
        return str(e), norms
    return None, norms


class Adoptable(nn.Module):
    """Parameters whose gradient can be its bucket's full gradient itself (Note [Adopted gradient]) and ones
    whose cannot, at ``bucket_mb`` so small that every parameter is a bucket of its own: ``big`` (adopted);
    ``twice`` (adopted, then its second accumulation under reentrant checkpointing added); ``a`` and ``b``
    (used through ``torch.cat``: their gradients are slices of one tensor, so not adopted); ``odd`` (63
    elements, padded on 2 ranks: not adopted); ``head`` (weight and bias, adopted). At ``bucket_mb`` of 16 KiB
    ``odd`` shares a bucket with ``head``'s bias (copied)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.randn(48, 64) / 8)
        self.b = nn.Parameter(torch.randn(48, 64) / 8)
        self.big = nn.Linear(64, 64, bias=False)
        self.twice = nn.Linear(64, 64, bias=False)
        self.odd = nn.Parameter(torch.randn(63) / 8)
        self.head = nn.Linear(96, 8)

    def forward(self, x):
        h = torch.tanh(self.big(x))
        h = checkpoint(self.twice, h, use_reentrant=True)
        h = checkpoint(self.twice, torch.tanh(h), use_reentrant=True)
        h = torch.tanh(h @ torch.cat([self.a, self.b]).t())  # (B, 96)
        h = h + nn.functional.pad(self.odd, (0, 33))
        return self.head(h).square().mean()


def adoption(stage: int, bucket_mb: float, steps: int = 3) -> dict:
    """:class:`Adoptable` under AdamW at ``stage`` for ``steps`` steps: the parameters after each step (full,
    on every rank), the gradient norms, and how many bucket gradients the reducer adopted from autograd."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Adoptable()
    g = torch.Generator().manual_seed(rank)
    batches = [torch.randn(4, 64, generator=g).requires_grad_(True) for _ in range(steps)]
    engine = initialize(model, optimizer="AdamW", optimizer_kwargs={"lr": 1e-2},
                        config=ZeroConfig(stage=stage, bucket_mb=bucket_mb, grad_clip=1.0,
                                          units=("Linear",) if stage == 3 else ()))
    params, norms = [], []
    for x in batches:
        engine.backward(engine(x))
        norms.append(float(engine.step()))
        params.append({k: v.tolist() for k, v in _params(engine, model).items()})
    single = [b.params[0] for b in engine.buffers if len(b.params) == 1 and b.unpadded_numel == b.numel]
    adoptable = [p for p in single if p is not model.a and p is not model.b]  # a, b: slices of one gradient
    return {"params": params, "norms": norms, "adopted": engine.reducer.adopted,
            "adoptable_per_step": len(adoptable), "cat_alone": sum(p is model.a or p is model.b for p in single)}


class SharedGradients(nn.Module):
    """Parameters whose gradients autograd hands over as tensors that share their storage with others: ``c`` and
    ``d`` are used through one sum of their views (both gradients are views of one tensor); ``pos`` is added
    to an activation of batch 1 through ``unsqueeze`` (its gradient is a view of the incoming gradient, which
    ``inp``'s backward still reads)."""

    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Parameter(torch.randn(32, 32) / 8)
        self.d = nn.Parameter(torch.randn(32, 32) / 8)
        self.inp = nn.Linear(32, 32)
        self.pos = nn.Parameter(torch.randn(16, 32) / 8)
        self.head = nn.Linear(32, 8)

    def forward(self, x):  # x: (1, 16, 32)
        w = (self.c.view(-1) + self.d.view(-1)).view(32, 32)
        h = self.inp(torch.tanh(x @ w)) + self.pos.unsqueeze(0)
        return self.head(torch.tanh(h)).square().mean()


def shared_gradients(stage: int, precision: str, steps: int = 3) -> dict:
    """:class:`SharedGradients`, SGD, every parameter a bucket of its own: the parameters (fp32) and gradient
    norms after each step, and how many gradients the reducer adopted."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = SharedGradients()
    g = torch.Generator().manual_seed(rank)
    batches = [torch.randn(1, 16, 32, generator=g) for _ in range(steps)]
    engine = initialize(model, optimizer="SGD", optimizer_kwargs={"lr": 0.1},
                        config=ZeroConfig(stage=stage, bucket_mb=1e-6, precision=precision))
    params, norms = [], []
    for x in batches:
        engine.backward(engine(x))
        norms.append(float(engine.step()))
        params.append({k: v.float().tolist() for k, v in _params(engine, model).items()})
    return {"params": params, "norms": norms, "adopted": engine.reducer.adopted}
