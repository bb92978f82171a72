"""Cases run on every rank of a gloo group by tests/test_outer_units.py (Note [Outer units] in
zerorun/zero/stage3_outer.py): the modules outside the listed stage-3 units."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from zerorun.zero import ZeroConfig, initialize, register_external_parameter

VOCAB, WIDTH, SEQ = 512, 32, 16


class Block(nn.Module):
    """``read``, when set: a callable giving a weight that the forward also reads, after its own work, into a side
    loss kept in ``aux`` (not returned: autograd reaches that read off the block's output's path)."""

    def __init__(self, d: int = WIDTH) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.read = self.aux = None

    def forward(self, x):
        out = x + self.down(torch.relu(self.up(self.norm(x))))
        self.aux = None if self.read is None else 1e-2 * F.linear(x, self.read()).square().mean()
        return out


class Latents(nn.Module):
    """Returns a view of its own parameter (as Hugging Face's Perceiver does), used by the blocks after it."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(1, SEQ, WIDTH) * 0.02)

    def forward(self, batch_size: int):
        return self.table.expand(batch_size, -1, -1)


class PenaltyHead(nn.Linear):
    """An LM head that also computes, inside its own forward, a penalty on its weight (``aux``, not returned)
    that the root adds to the loss: autograd reads the weight on a path that does not pass its output."""

    def forward(self, x):
        out = super().forward(x)
        self.aux = 1e-2 * self.weight.square().sum()
        return out


class TinyGPT(nn.Module):
    """Token embedding, a position table on the root, ``depth`` blocks, final norm and LM head; ``tied``: the head's
    weight is the embedding's; ``head_by_weight``: the root reads the head's weight itself instead of calling
    it; ``final_norm``: off, no ``ln_f``; ``head_penalty``, ``detach_aux`` and ``root_penalty``: losses that
    make autograd read the head's weight off its output's path (:class:`PenaltyHead`, ``head.weight.detach()``,
    a penalty in the root); ``probe``: a block (a listed unit) called after the head, whose output is unused and
    whose side loss (:class:`Block`'s ``aux``) reads the head's weight where ``probe_reads`` is set;
    ``frozen_wte``: the token embedding frozen (no gradient flows through it); ``block_reads``: the last block's side
    loss reads that module's weight detached (``"head"``, ``"ln_f"``) or through ``.data`` (``"head.data"``);
    ``block_penalty``: the root adds a penalty on the first block's weight (a listed unit's, read after it ran);
    ``root_writes``: the root clamps the final norm's weight (True), or scales a block's bias after the blocks ran
    (``"blocks.0"``, ``"blocks.3"``: the last one, kept from forward to backward by default); ``extra``:
    a Linear on the root, run where ``batch[1]`` says (``"start"``, ``"end"`` or ``None``: not at all);
    ``batch[2]``, when given: the blocks to skip (LayerDrop, the same on every rank)."""

    def __init__(self, depth: int = 4, tied: bool = False, head_by_weight: bool = False, max_norm: bool = False,
                 root_writes: bool | str = False, latents: bool = False, final_norm: bool = True,
                 head_penalty: bool = False, detach_aux: bool = False, probe: bool = False,
                 frozen_wte: bool = False, block_reads: str | None = None, block_penalty: bool = False) -> None:
        super().__init__()
        self.block_penalty = block_penalty
        self.wte = nn.Embedding(VOCAB, WIDTH, max_norm=0.5 if max_norm else None).requires_grad_(not frozen_wte)
        self.latents = Latents() if latents else None
        self.root_writes = root_writes
        self.fail_at: int | None = None  # a forward that raises before this block (interrupted, caught)
        self.experts = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(3))  # on the root: one outer unit
        self.use_experts: tuple = ()  # which of them run after the blocks
        self.wpe = nn.Parameter(torch.randn(SEQ, WIDTH) * 0.02)
        self.blocks = nn.ModuleList(Block() for _ in range(depth))
        self.extra = nn.Linear(WIDTH, WIDTH)
        self.ln_f = nn.LayerNorm(WIDTH) if final_norm else None
        self.head = (PenaltyHead if head_penalty else nn.Linear)(WIDTH, VOCAB, bias=False)
        self.detach_aux = detach_aux
        self.root_penalty = False  # set per step by train(penalty_from=...)
        self.probe, self.probe_reads = (Block() if probe else None), False  # probe_reads: by train(probe_from=...)
        if block_reads:  # a block's side loss through another module's weight, detached (Block.read)
            name, _, how = block_reads.partition(".")  # "head", "ln_f" (detach()), "head.data"
            self.blocks[-1].read = (lambda: getattr(self, name).weight.data) if how else (
                lambda: getattr(self, name).weight.detach())
        if tied:
            self.head.weight = self.wte.weight
        self.head_by_weight = head_by_weight

    def forward(self, batch):
        ids, extra, *skip = batch
        x = self.wte(ids) + self.wpe[: ids.shape[1]]
        if self.latents is not None:
            x = x + self.latents(x.shape[0])
        if self.root_writes is True:
            with torch.no_grad():
                self.ln_f.weight.clamp_(max=0.9)
        if extra == "start":
            x = x + self.extra(x)
        for i, block in enumerate(self.blocks):
            if i == self.fail_at:
                raise ValueError("interrupted")
            if not skip or i not in skip[0]:
                x = block(x)
        if self.root_writes in ("blocks.0", "blocks.3"):  # a block written after it ran (kept, or at rest)
            with torch.no_grad():
                self.blocks[int(self.root_writes[-1])].down.bias.mul_(0.9)
        if extra == "end":
            x = x + self.extra(x)
        for i in self.use_experts:
            x = x + self.experts[i](x)
        x = self.ln_f(x) if self.ln_f is not None else x
        logits = F.linear(x, self.head.weight) if self.head_by_weight else self.head(x)
        loss = F.cross_entropy(logits.flatten(0, 1), ids.flatten())
        if isinstance(self.head, PenaltyHead):
            loss = loss + self.head.aux
        if self.root_penalty:  # the root reads the head's weight (a regularizer switched on after warmup)
            loss = loss + 1e-2 * self.head.weight.square().sum()
        if self.block_penalty:
            loss = loss + 1e-2 * self.blocks[0].up.weight.square().sum()
        if self.detach_aux:  # an auxiliary loss through the head's weight, stop-gradient
            loss = loss + 1e-2 * F.linear(x, self.head.weight.detach()).square().mean()
        for block in self.blocks:
            loss = loss + block.aux if block.aux is not None else loss
        if self.probe is not None:
            self.probe.read = (lambda: self.head.weight) if self.probe_reads else None
            self.probe(x)
            loss = loss + self.probe.aux if self.probe.aux is not None else loss
        return loss


def _engine(stage: int, accum: int = 1, checkpointing: bool = False, declare: bool = False, keep: int | None = 0,
            **model_kw):
    """``keep``: ``zero.keep_root_bytes`` (``None``: its default, under which TinyGPT's root and outer units, all
    small, are kept from forward to backward); 0, the cases' default, frees them after every forward, so that the
    tails are deferred (Note [Kept from forward to backward])."""
    torch.manual_seed(0)
    model = TinyGPT(**model_kw)
    if declare:
        register_external_parameter(model, model.extra.weight)
        register_external_parameter(model, model.extra.bias)
    return initialize(model, optimizer="AdamW", optimizer_kwargs={"lr": 1e-2},
                      config=ZeroConfig(stage=stage, grad_accum_steps=accum, units=("Block",) if stage == 3 else (),
                                        activation_checkpointing=checkpointing and stage == 3,
                                        **({} if keep is None else {"keep_root_bytes": keep})))


def _batches(steps: int, accum: int) -> list:
    g = torch.Generator().manual_seed(dist.get_rank())
    return [torch.randint(0, VOCAB, (2, SEQ), generator=g) for _ in range(steps * accum)]


def _read_head(model: nn.Module, grad: torch.Tensor) -> torch.Tensor:
    with torch.enable_grad():  # recorded by autograd: a use of the values, not a detached peek
        model.head.weight.sum()
    return grad


def train(stage: int, steps: int = 4, accum: int = 1, extras=(None,), checkpointing: bool = False,
          declare: bool = False, evaluate: bool = False, skips=None, hook_after: bool = False,
          interrupt: bool = False, experts=None, penalty_from: int | None = None, read_in_backward: bool = False,
          probe_from: int | None = None, keep: int | None = 0, grad_eval: bool = False, between: str = "",
          **model_kw) -> dict:
    """Losses and grad norms of ``steps`` steps of :class:`TinyGPT` (``extras[step]``, per rank: a dict
    ``{rank: where}`` or one value for all, says where ``extra`` runs; the last entry repeats; ``skips[step]``:
    the blocks LayerDrop skips; ``interrupt``: before each optimizer step, a forward that raises half way,
    caught; ``experts[step][micro_step]``: the root experts that run; ``penalty_from``: the step from which the
    root adds a penalty on the head's weight; ``probe_from``: the step from which the probe block reads it;
    ``read_in_backward``: from the second step, a hook on the loss reads
    the head's weight with gradients on, before the head's backward; ``grad_eval``: before each optimizer step,
    a forward with gradients on whose loss no backward follows; ``keep``: :func:`_engine`'s; ``between``: user
    code between each forward and its backward from the second step on, :func:`_between`), the outer units'
    schedules, the units kept from forward to backward, the bytes sent in each step, and the error of the first
    step that raised."""
    engine = _engine(stage, accum, checkpointing, declare, keep, **model_kw)
    batches = _batches(steps, accum)
    out = {"losses": [], "norms": [], "error": None, "reads": [], "sent": []}
    rank = dist.get_rank()
    try:
        for step in range(steps):
            engine.module.root_penalty = penalty_from is not None and step >= penalty_from
            engine.module.probe_reads = probe_from is not None and step >= probe_from
            sent = engine.comm_stats()["bytes_sent"]
            where = extras[min(step, len(extras) - 1)]
            where = where.get(rank) if isinstance(where, dict) else where
            if evaluate:  # before the step (the first: while the schedule is learned) and after it
                with torch.no_grad():
                    out["losses"].append(float(engine((batches[0], None))))
            if hook_after and step == 1:  # a forward hook reading the embedding's weight, added after step 1
                engine.module.wte.register_forward_hook(
                    lambda m, a, o: out["reads"].append(float(m.weight.detach().norm())))
            for i in range(accum):
                here = where[i] if isinstance(where, list) else where  # a list: where, per micro-step
                if experts:
                    engine.module.use_experts = experts[min(step, len(experts) - 1)][i]
                batch = (batches[step * accum + i], here) + ((set(skips[step]),) if skips else ())
                loss = engine(batch)
                loss, alias = _between(engine, between if step >= 1 else "", loss)
                if read_in_backward and step >= 1:
                    loss.register_hook(lambda grad: _read_head(engine.module, grad))
                engine.backward(loss)
                out["losses"].append(float(loss))
                if alias is not None:  # read after the backward that freed what it viewed
                    out["reads"].append(float(alias.norm()))
            if interrupt:
                engine.module.fail_at = 2
                try:
                    engine((batches[0], None))
                except ValueError:
                    pass
                engine.module.fail_at = None
            if grad_eval:  # the units it keeps gathered must not outlive the step: stale values after it
                out["losses"].append(float(engine((batches[0], None))))
            out["norms"].append(float(engine.step()))
            out["sent"].append(engine.comm_stats()["bytes_sent"] - sent)
            if evaluate:
                with torch.no_grad():
                    out["losses"].append(float(engine((batches[0], None))))
    except RuntimeError as e:
        out["error"] = str(e)
    if stage == 3:
        rec = engine.sched.outer.rec  # Note [Outer units]: what the first step learned of each
        out["schedule"] = {u.name: (rec[u].scheduled, rec[u].bfirst) for u in engine.units if u.outer}
        out["tails"] = {u.name: rec[u].tail for u in engine.units if u.outer}
        out["kept"] = sorted(u.name or "<root>" for u in engine.sched.outer.kept())
    return out


def _between(engine, what: str, loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """User code between a forward and its backward (Note [Kept from forward to backward]): ``"penalty"`` adds
    one on the head's weight to the loss, ``"write_bias"`` adds to the final norm's bias in place, ``"detach_head"``
    takes the head's weight detached (returned, read after the backward), each after an empty
    ``gathered_parameters`` block where prefixed ``"gathered_"``; ``"probe"``: the probe block called directly,
    its side loss reading the head's weight, added to the loss; ``"last_block"``: the last block called again, its
    output's mean added to the loss; ``"detach_last_block"``: its first weight taken detached (as ``"detach_head"``);
    ``""``: nothing."""
    model = engine.module
    if what.startswith("gathered_"):
        with engine.gathered_parameters([]) if engine.stage == 3 else contextlib.nullcontext():
            pass
        what = what.removeprefix("gathered_")
    if what == "probe":
        model.probe.read = lambda: model.head.weight
        model.probe(torch.ones(2, SEQ, WIDTH))
        return loss + model.probe.aux, None
    if what == "last_block":
        return loss + model.blocks[-1](torch.ones(2, SEQ, WIDTH)).mean(), None
    if what == "detach_last_block":
        return loss, model.blocks[-1].up.weight.detach()
    if what == "penalty":
        return loss + 0.1 * model.head.weight.square().sum(), None
    if what == "write_bias":
        with torch.no_grad():
            model.ln_f.bias.add_(0.5)
    return loss, model.head.weight.detach() if what == "detach_head" else None


def gathered_at_points(steps: int = 3, with_root: bool = False, keep: int | None = 0) -> dict:
    """Stage 3, :class:`TinyGPT` with 4 blocks, ``steps`` steps: which outer units are gathered (or being
    gathered) when each block's forward and each block's backward begins and when the loss's backward reaches
    the logits (``"loss backward"``, before the head's backward), and the most parameter bytes
    gathered at those points (outer, root and listed units together: what sits beside the activations), per
    step, and how many times each was all-gathered before the first block's backward. ``with_root``: the
    embedding declared read by the root, so kept with it (as before outer units); ``keep``: :func:`_engine`'s."""
    engine = _engine(3, keep=keep)
    model = engine.module
    if with_root:
        register_external_parameter(model, model.wte.weight)
    watched = {name: getattr(model, name).weight for name in ("wte", "ln_f", "head")}
    record: list[tuple[str, list[str]]] = []
    top = {"bytes": 0}

    def now(tag: str) -> None:  # whole: the storage holds every element (at rest: a 1-element placeholder)
        with torch._C.DisableTorchFunctionSubclass():  # not a use of the values (Note [Parameters at rest])
            record.append((tag, [n for n, p in watched.items() if p.untyped_storage().nbytes() >= p.nbytes]))
        gathered = sum(b.data.untyped_storage().nbytes() for u in engine.units if not u.persistent for b in u.buffers)
        top["bytes"] = max(top["bytes"], gathered)
        if tag == "backward 0":  # the units' all-gathers so far in this step (Note [Same units on every rank])
            index = {u.index: u.name for u in engine.units}
            top["gathers"] = [index[i] for i in engine.gathering.log]

    for i, block in enumerate(engine.module.blocks):
        block.register_forward_pre_hook(lambda m, a, i=i: now(f"forward {i}") if torch.is_grad_enabled() else None)
        block.register_full_backward_pre_hook(lambda m, g, i=i: now(f"backward {i}"))

    def probe(module, args, output):  # the head's logits through a copy whose gradient comes just before theirs
        if not torch.is_grad_enabled():
            return None
        logits = output.clone()
        logits.register_hook(lambda grad: now("loss backward"))
        return logits

    model.head.register_forward_hook(probe)
    out = []
    for ids in _batches(steps, 1):
        record.clear()
        top["bytes"] = 0
        engine.backward(engine((ids, None)))
        engine.step()
        out.append({"points": list(record), "max_bytes": top["bytes"],
                    "gathers": {n: top["gathers"].count(n) for n in watched}})
    return {"steps": out, "sizes": {name: p.nbytes for name, p in watched.items()}}



def kept_on_one_rank(steps: int = 3) -> dict:
    """:func:`train` at stage 3 with the default ``zero.keep_root_bytes`` (the last block is kept from each forward
    into its backward: Note [Kept from forward to backward]), but rank 1 never keeps it (``Schedule.keeps_last``
    made false there): the agreement before backward must free it on every rank, so that every rank all-gathers it
    again in backward."""
    from zerorun.zero.stage3_schedule import Schedule

    keeps_last = Schedule.keeps_last
    if dist.get_rank() == 1:
        Schedule.keeps_last = lambda self, unit: False
    try:
        return train(stage=3, steps=steps, keep=None)
    finally:
        Schedule.keeps_last = keeps_last
