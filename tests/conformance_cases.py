"""Model kinds users bring, run on every rank of a :class:`distributed.RankPool`: each kind trains at stages
1-3 and at stage 0 from the same seed on the same per-rank batches, step by step (issue 15: the model stays
the user's model). A kind either matches stage 0 (losses, grad norms, final parameters; also what it logs),
or, where stage 3 cannot give stage 0's result, raises a clear error whose message the test asserts.

:func:`run_all` runs every kind at every stage in one call (one launch of the ranks serves them all) and
returns ``{kind: {stage: result}}``; a result is ``{"loss": [...], "norm": [...], "params": {...}, ...}``
or ``{"error": "<type>: <message>"}``.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import typing
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from zerorun.zero import ZeroConfig, deferred_init, initialize, register_external_parameter

STEPS = 3


@dataclasses.dataclass
class Hidden:
    h: torch.Tensor
    tag: str = "x"


class HasH:  # a plain object holding the tensor in an attribute
    def __init__(self, h):
        self.h = h


class NT(typing.NamedTuple):
    h: torch.Tensor
    note: str


@dataclasses.dataclass
class LossOut:  # a dataclass with a .loss field, returned by the root
    loss: torch.Tensor
    logits: torch.Tensor


class HFLike:  # an object with .loss (as transformers' outputs are used)
    def __init__(self, loss, logits):
        self.loss, self.logits = loss, logits


def wrap(h: torch.Tensor, out: str):
    return {"tensor": lambda: h, "dataclass": lambda: Hidden(h), "object": lambda: HasH(h),
            "namedtuple": lambda: NT(h, "n"), "nested": lambda: {"a": [None, (h, "s")], "k": 1}}[out]()


def unwrap(o, out: str) -> torch.Tensor:
    return {"tensor": lambda: o, "dataclass": lambda: o.h, "object": lambda: o.h, "namedtuple": lambda: o.h,
            "nested": lambda: o["a"][1][0]}[out]()


def _mask_two_rows(g: torch.Tensor) -> torch.Tensor:
    g = g.clone()
    g[:2] = 0
    return g


def _halve_grad(p: nn.Parameter) -> None:
    p.grad.mul_(0.5)


def _log_and_halve(logged: list, p: nn.Parameter) -> None:
    """A post-accumulate hook registered after ``initialize``: this rank's gradient is there, and halving it
    halves what is reduced (Note [User gradient hooks run first]); before, ``p.grad`` was None at stages 2-3."""
    logged.append(float(p.grad.norm()))
    p.grad.mul_(0.5)


class Block(nn.Module):
    """The unit class (``zero.units: [Block]``)."""

    def __init__(self, d: int = 16, out: str = "tensor", expert: bool = False) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.expert = nn.Linear(d, d) if expert else None
        self.out = out
        self.borrow: list[nn.Module] = []  # another block whose weight this one reads (not a submodule)
        self.clamp = False  # a max-norm style constraint written into the weight inside the forward

    def forward(self, h, use_expert: bool = True):
        if self.clamp:
            with torch.no_grad():
                self.fc.weight.clamp_(-0.1, 0.1)
        y = h + torch.tanh(self.fc(h))
        if self.expert is not None and use_expert:
            y = y + self.expert(y)
        if self.borrow:  # a weight of another unit used here (tied by attribute)
            y = y + 0.1 * F.linear(y, self.borrow[0].fc.weight)
        return wrap(y, self.out)


class Net(nn.Module):
    """inp -> 2 Blocks -> head; ``kind`` adds the structure under test."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        out = kind.removeprefix("unit_out_") if kind.startswith("unit_out_") else "tensor"
        self.inp = nn.Linear(8, 16)
        depth = 6 if kind == "expert_some_ranks" else 2  # enough buckets in flight to wait for one in a hook
        self.blocks = nn.ModuleList(Block(16, out, expert=kind == "expert_some_ranks") for _ in range(depth))
        if kind.startswith("experts_sizes"):  # experts of different sizes: the second one twice the first
            self.blocks[1] = Block(16, out, expert=True)
        self.head = nn.Linear(16, 4)
        self.out = out
        self.logged: list[float] = []
        self.calls = 0
        if kind == "grad_hook":  # masks two rows of a weight's gradient (partial training)
            mask = torch.ones(16, 8)
            mask[:2] = 0
            self.inp.weight.register_hook(lambda g: g * mask)
        if kind == "grad_hook_nocapture":  # the same mask, made from the gradient (captures no tensor)
            self.inp.weight.register_hook(_mask_two_rows)
        if kind == "post_accumulate_hook":
            self.head.weight.register_post_accumulate_grad_hook(_halve_grad)
        if kind == "sparse_embedding":  # Note [Sparse gradients]: before, stages 2-3 raised torch's copy_ error
            self.emb = nn.Embedding(4, 16, sparse=True)
        if kind == "clamp_in_forward":
            self.blocks[1].clamp = True
        if kind == "tied_by_attribute":
            self.blocks[1].borrow.append(self.blocks[0])
        if kind == "penalty_declared":
            register_external_parameter(self, self.blocks[0].fc.weight)
        if kind in ("unfreeze", "freeze_later"):
            self.head.requires_grad_(kind == "freeze_later")
        if kind == "zero_element":
            self.empty = nn.Parameter(torch.randn(0, 16))  # zero elements
            self.scale = nn.Parameter(torch.ones(1))  # a param group of one element

    def forward(self, batch):
        x, y = batch["x"], batch["y"]
        self.calls += 1
        if self.kind in ("unfreeze", "freeze_later") and self.calls == 2:
            self.head.requires_grad_(self.kind == "unfreeze")
        rank = dist.get_rank()
        h = self.inp(x)
        if self.kind in ("experts_per_rank", "experts_sizes_per_rank"):  # each rank runs another unit
            h = unwrap(self.blocks[rank % 2](h), self.out)
        elif self.kind in ("experts_order_per_rank", "experts_sizes_order_per_rank"):  # every unit, rank's order
            for b in (self.blocks if rank % 2 == 0 else list(self.blocks)[::-1]):
                h = unwrap(b(h), self.out)
        else:
            for b in self.blocks:
                h = unwrap(b(h, rank == 0) if self.kind == "expert_some_ranks" else b(h), self.out)
        if self.kind == "zero_element":
            h = (h + (h @ self.empty.t()).sum(-1, keepdim=True)) * self.scale
        if self.kind == "sparse_embedding":
            h = h + self.emb(y)
        if self.kind == "half_in_forward" and self.calls >= 2:  # a review: stage 2 then trained nothing, exit 0
            self.head.half()
            logits = self.head(h.half()).float()
        else:
            logits = self.head(h)
        loss = F.cross_entropy(logits, y)
        if self.kind in ("penalty", "penalty_declared"):  # a unit's weight read after the unit ran
            loss = loss + 1e-2 * self.blocks[0].fc.weight.pow(2).sum()
        if self.kind == "norm_in_forward":
            with torch.no_grad():
                self.logged.append(float(sum(p.norm() ** 2 for p in self.parameters())))
        if self.kind == "root_out_dataclass":
            return LossOut(loss, logits)
        if self.kind == "root_out_object":
            return HFLike(loss, logits)
        return {"loss": loss, "logits": logits}


def _loss(out):
    return out["loss"] if isinstance(out, dict) else out.loss


def _batch(step: int, rank: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    return {"x": torch.randn(5, 8, generator=g), "y": torch.randint(0, 4, (5,), generator=g)}


def _full(engine) -> dict[str, torch.Tensor]:
    sd = engine.full_state_dict(rank0_only=False) if engine.stage == 3 else engine.state_dict()
    return {k: v.detach().clone().float() for k, v in sd.items()}


def train(kind: str, stage: int, steps: int = STEPS, group=None) -> dict:
    """Train ``Net(kind)`` (seed 0) for ``steps`` steps at ``stage``; per-step loss and grad norm, the final
    full parameters and what the model logged. Errors are returned as ``{"error": ...}``."""
    torch.manual_seed(0)
    if kind == "grad_hook_deferred":  # built on the meta device (zero.meta_init), hook registered there
        model = deferred_init(Net, "grad_hook_nocapture")
    elif kind == "grad_hook_meta_capture":  # ... holding a tensor made there: built normally (with a warning)
        model = deferred_init(Net, "grad_hook")
    else:
        model = Net(kind)
    groups = None
    if kind == "zero_element":
        groups = [{"params": [p for n, p in model.named_parameters() if n != "scale"], "weight_decay": 0.1},
                  {"params": [model.scale], "weight_decay": 0.0}]
    config = ZeroConfig(stage=stage, units=("Block",) if stage == 3 else (), grad_clip=1.0,
                        bucket_mb=0.001 if kind == "expert_some_ranks" else 25.0)
    out: dict = {"loss": [], "norm": []}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            engine = initialize(model, optimizer="AdamW", optimizer_kwargs={"lr": 1e-2, "weight_decay": 0.1},
                                param_groups=groups, config=config, process_group=group)
            rank = dist.get_rank(group)
            if kind == "post_accumulate_hook_later":  # a unit's weight and a root one
                for p in (model.blocks[0].fc.weight, model.head.weight):
                    p.register_post_accumulate_grad_hook(functools.partial(_log_and_halve, model.logged))
            for step in range(steps):
                if kind == "replace" and step == 1:
                    model.head.weight = nn.Parameter(torch.zeros(4, 16))
                if kind == "write_at_rest" and step == 1:
                    with torch.no_grad():
                        model.blocks[0].fc.weight.fill_(0.25)
                if kind == "data_swap" and step == 1:  # new memory, not the engine's: its updates went nowhere
                    model.head.weight.data = model.head.weight.data.clone()
                if kind == "data_write_at_rest" and step == 1:
                    model.blocks[0].fc.weight.data.fill_(0.25)
                if kind == "gathered_write" and step == 1:
                    w = model.blocks[0].fc.weight
                    with engine.gathered_parameters([w], modifier_rank=0), torch.no_grad():
                        if rank == 0:
                            w.fill_(0.25)
                if kind == "read_at_rest" and step == 1:
                    out["read"] = float(model.blocks[1].fc.weight.norm())
                if kind == "gathered_read" and step == 1:
                    with engine.gathered_parameters(model.parameters()):
                        out["read"] = float(model.blocks[1].fc.weight.norm())
                if kind == "module_state_dict" and step == 1:
                    out["read"] = float(model.state_dict()["blocks.1.fc.weight"].norm())
                loss = _loss(engine(_batch(step, rank)))
                engine.backward(loss)
                out["norm"].append(float(engine.step()))
                out["loss"].append(float(loss))
            out["params"] = _full(engine)
            out["logged"] = list(model.logged)
    except Exception as e:  # noqa: BLE001 - the test asserts the message
        if os.environ.get("CONFORMANCE_TRACEBACK"):
            import traceback
            traceback.print_exc()
        return {"error": f"{type(e).__name__}: {e}"}
    return out


#: kinds that must match stage 0 at every stage
MATCH = ["plain", "grad_hook", "grad_hook_deferred", "grad_hook_meta_capture", "post_accumulate_hook",
         "post_accumulate_hook_later", "sparse_embedding", "penalty",
         "penalty_declared", "tied_by_attribute",
         "norm_in_forward", "unit_out_dataclass", "unit_out_object", "unit_out_namedtuple", "unit_out_nested",
         "root_out_dataclass", "root_out_object", "expert_some_ranks", "zero_element", "gathered_write",
         "gathered_read"]
#: kinds that raise at the given stages (all other stages match stage 0), with a part of the message
ERRORS = {
    "experts_per_rank": ((3,), "reaches the loss on some ranks only"),  # before backward: no hang
    "experts_order_per_rank": ((3,), "ranks ran different units"),  # agreed before backward
    # experts of different sizes: their all-gathers are of one size (Note [Peer units]), so as above
    "experts_sizes_per_rank": ((3,), "reaches the loss on some ranks only"),
    "experts_sizes_order_per_rank": ((3,), "ranks ran different units"),
    "unfreeze": ((1, 2, 3), "'head.weight' was unfrozen"),
    "freeze_later": ((1, 2, 3), "'head.weight' was frozen"),
    "replace": ((1, 2, 3), "'head.weight' was replaced"),
    "half_in_forward": ((1, 2, 3), "'head.weight' was cast to torch.float16 after zerorun.initialize"),
    "write_at_rest": ((3,), "'blocks.0.fc.weight' is partitioned"),
    "read_at_rest": ((3,), "'blocks.1.fc.weight' is partitioned"),
    "data_write_at_rest": ((3,), "'blocks.0.fc.weight' is partitioned"),
    "module_state_dict": ((3,), "full_state_dict"),
    "clamp_in_forward": ((3,), "'blocks.1.fc.weight' was written in place inside the forward of its unit"),
}
#: kinds whose stage 0 itself raises the same error (so there is no reference run to compare)
STAGE0_ERRORS = {"unfreeze", "freeze_later", "replace", "half_in_forward"}


def run_all(kinds: list[str] | None = None) -> dict:
    """Every kind at stages 0-3 (``kinds``: a subset); ``{kind: {stage: result}}``."""
    kinds = kinds or MATCH + list(ERRORS)
    return {kind: {stage: train(kind, stage) for stage in (0, 1, 2, 3)} for kind in kinds}


def subgroup(stage: int) -> dict:
    """Stage ``stage`` on a process group that is not the world: ranks {0, 1} form one replica, the rest
    another; each replica trains the plain kind. Returns the per-step losses and norms."""
    world = dist.get_world_size()
    groups = [dist.new_group([0, 1]), dist.new_group(list(range(2, world)) or [0])]
    mine = groups[0] if dist.get_rank() < 2 else groups[1]
    return train("plain", stage, group=mine)


def subgroup_mismatch() -> dict:
    """Ranks 1 and 2 of 3 form one replica (rank 0 alone the other) and run their experts in different
    orders at stage 3: the error names the ranks as the job numbers them (1 and 2), not their places in the
    replica."""
    groups = [dist.new_group([0]), dist.new_group([1, 2])]
    return train("experts_order_per_rank", 3, group=groups[0] if dist.get_rank() == 0 else groups[1])


def persistent_frozen_resume(root: str) -> dict:
    """Stage 3 with ``zero.persistence_threshold``: a frozen small (persistent) parameter is saved, a model
    built from another seed loads the checkpoint; the largest difference between the saved and the loaded
    full state dicts (0 when the resume is exact)."""
    from zerorun import checkpoint

    def build(seed: int):
        torch.manual_seed(seed)
        model = Net("plain")
        model.blocks[0].fc.bias.requires_grad_(False)
        engine = initialize(model, optimizer="AdamW", optimizer_kwargs={"lr": 1e-2},
                            config=ZeroConfig(stage=3, units=("Block",), persistence_threshold=20))
        return engine, torch.optim.lr_scheduler.LambdaLR(engine.optimizer, lambda s: 1.0)

    engine, sched = build(0)
    engine.backward(_loss(engine(_batch(0, dist.get_rank()))))
    engine.step()
    path, _, _ = checkpoint.save(engine, root, 1, scheduler=sched, position=checkpoint.DataPosition(),
                                 recipe={"train": {"micro_batch_size": 5}}, keep=2)
    saved = _full(engine)
    resumed, sched2 = build(1)
    checkpoint.load(path, resumed, scheduler=sched2, micro_batch_size=5)
    got = _full(resumed)
    return {k: float((got[k] - saved[k]).abs().max()) for k in saved}






def _consolidate_zero_element(root: str, stage: int) -> dict:
    """The zero-element kind (a zero-element parameter, a one-element param group) trained one step at
    ``stage``, checkpointed and consolidated (rank 0): the largest difference between the consolidated
    tensors and the engine's full state dict, per key."""
    from zerorun import checkpoint

    torch.manual_seed(0)
    model = Net("zero_element")
    groups = [{"params": [p for n, p in model.named_parameters() if n != "scale"]}, {"params": [model.scale]}]
    engine = initialize(model, optimizer="AdamW", optimizer_kwargs={"lr": 1e-2}, param_groups=groups,
                        config=ZeroConfig(stage=stage, units=("Block",) if stage == 3 else ()))
    engine.backward(_loss(engine(_batch(0, dist.get_rank()))))
    engine.step()
    full = _full(engine)
    sched = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, lambda s: 1.0)
    path, _, _ = checkpoint.save(engine, root, 1, scheduler=sched, position=checkpoint.DataPosition(),
                                 recipe={"train": {"micro_batch_size": 5}}, keep=2)
    dist.barrier()
    if dist.get_rank() != 0:
        return {}
    out = os.path.join(root, "model.pt")
    checkpoint.consolidate(path, out)
    got = torch.load(out, weights_only=True)
    assert got.keys() == full.keys(), (sorted(got), sorted(full))
    return {k: float((got[k].float() - full[k]).abs().max()) if full[k].numel() else 0.0 for k in full}


def consolidate_zero_element(root: str) -> dict:
    """:func:`_consolidate_zero_element` at stages 0-3 (in folders of ``root``): ``{stage: {key: diff}}``."""
    return {stage: _consolidate_zero_element(os.path.join(root, f"s{stage}"), stage) for stage in (0, 1, 2, 3)}


def gathered_write_mixed(precision: str = "bf16") -> dict:
    """Rank 0 writes a weight inside ``gathered_parameters(modifier_rank=0)`` under ``precision`` (separate
    fp32 master slices) at every stage, then one step: ``{stage: that weight after the step}``. The write
    must reach the masters, or the step would revert it."""
    out = {}
    for stage in (0, 1, 2, 3):
        torch.manual_seed(0)
        model = Net("plain")
        engine = initialize(model, optimizer="SGD", optimizer_kwargs={"lr": 1e-3},
                            config=ZeroConfig(stage=stage, units=("Block",) if stage == 3 else (),
                                              precision=precision))
        w = model.blocks[0].fc.weight
        with engine.gathered_parameters([w], modifier_rank=0), torch.no_grad():
            if dist.get_rank() == 0:
                w.fill_(0.25)
        engine.backward(_loss(engine(_batch(0, dist.get_rank()))))
        engine.step()
        out[stage] = _full(engine)["blocks.0.fc.weight"]
    return out


def gathered_write_then_raise(stage: int) -> dict:
    """Rank 0 writes a weight inside ``gathered_parameters(modifier_rank=0)``, then the block raises on every rank
    (caught), then one step: the weight right after the block and the full state dict after the step, per rank.
    Plain PyTorch keeps a write made before an exception, so every rank must hold rank 0's."""
    torch.manual_seed(0)
    model = Net("plain")
    engine = initialize(model, optimizer="SGD", optimizer_kwargs={"lr": 1e-3},
                        config=ZeroConfig(stage=stage, units=("Block",) if stage == 3 else ()))
    w = model.blocks[0].fc.weight
    try:
        with engine.gathered_parameters([w], modifier_rank=0), torch.no_grad():
            if dist.get_rank() == 0:
                w.fill_(0.25)
            raise ValueError("a check inside the block failed")
    except ValueError:
        pass
    after_block = _full(engine)["blocks.0.fc.weight"]
    engine.backward(_loss(engine(_batch(0, dist.get_rank()))))
    engine.step()
    return {"after_block": after_block, "after_step": _full(engine)}


def data_swap() -> dict:
    """``p.data = ...`` between steps at stages 0-2 (stage 3 refuses the read of ``.data`` at rest): ``{stage:
    result}``."""
    return {stage: train("data_swap", stage) for stage in (0, 1, 2)}
