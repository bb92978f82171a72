"""Cases run on every rank of a gloo group by tests/test_outer_units.py (Note [Outer units] in
zerorun/zero/stage3_outer.py): the modules outside the listed stage-3 units."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from zerorun.zero import ZeroConfig, initialize, register_external_parameter

VOCAB, WIDTH, SEQ = 512, 32, 16


class Block(nn.Module):
    def __init__(self, d: int = WIDTH) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


class TinyGPT(nn.Module):
    """Token embedding, a position table on the root, ``depth`` blocks, final norm and LM head; ``tied``: the
    head's weight is the embedding's; ``head_by_weight``: the root reads the head's weight itself instead of
    calling it; ``extra``: a Linear on the root, run where ``batch[1]`` says (``"start"``, ``"end"`` or
    ``None``: not at all)."""

    def __init__(self, depth: int = 4, tied: bool = False, head_by_weight: bool = False) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.wpe = nn.Parameter(torch.randn(SEQ, WIDTH) * 0.02)
        self.blocks = nn.ModuleList(Block() for _ in range(depth))
        self.extra = nn.Linear(WIDTH, WIDTH)
        self.ln_f = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        if tied:
            self.head.weight = self.wte.weight
        self.head_by_weight = head_by_weight

    def forward(self, batch):
        ids, extra = batch
        x = self.wte(ids) + self.wpe[: ids.shape[1]]
        if extra == "start":
            x = x + self.extra(x)
        for block in self.blocks:
            x = block(x)
        if extra == "end":
            x = x + self.extra(x)
        x = self.ln_f(x)
        logits = F.linear(x, self.head.weight) if self.head_by_weight else self.head(x)
        return F.cross_entropy(logits.flatten(0, 1), ids.flatten())


def _engine(stage: int, accum: int = 1, checkpointing: bool = False, declare: bool = False, **model_kw):
    torch.manual_seed(0)
    model = TinyGPT(**model_kw)
    if declare:
        register_external_parameter(model, model.extra.weight)
        register_external_parameter(model, model.extra.bias)
    return initialize(model, optimizer="AdamW", optimizer_kwargs={"lr": 1e-2},
                      config=ZeroConfig(stage=stage, grad_accum_steps=accum, units=("Block",) if stage == 3 else (),
                                        activation_checkpointing=checkpointing))


def _batches(steps: int, accum: int) -> list:
    g = torch.Generator().manual_seed(dist.get_rank())
    return [torch.randint(0, VOCAB, (2, SEQ), generator=g) for _ in range(steps * accum)]


def train(stage: int, steps: int = 4, accum: int = 1, extras=(None,), checkpointing: bool = False,
          declare: bool = False, evaluate: bool = False, **model_kw) -> dict:
    """Losses and grad norms of ``steps`` steps of :class:`TinyGPT` (``extras[step]``, per rank: a dict
    ``{rank: where}`` or one value for all, says where ``extra`` runs; the last entry repeats), the outer
    units' schedules, and the error of the first step that raised (``None``)."""
    engine = _engine(stage, accum, checkpointing, declare, **model_kw)
    batches = _batches(steps, accum)
    out = {"losses": [], "norms": [], "error": None}
    rank = dist.get_rank()
    try:
        for step in range(steps):
            where = extras[min(step, len(extras) - 1)]
            where = where.get(rank) if isinstance(where, dict) else where
            if evaluate:  # before the step (the first: while the schedule is learned) and after it
                with torch.no_grad():
                    out["losses"].append(float(engine((batches[0], where))))
            for i in range(accum):
                loss = engine((batches[step * accum + i], where))
                engine.backward(loss)
                out["losses"].append(float(loss))
            out["norms"].append(engine.step())
            if evaluate:
                with torch.no_grad():
                    out["losses"].append(float(engine((batches[0], where))))
    except RuntimeError as e:
        out["error"] = str(e)
    if stage == 3:
        out["schedule"] = {u.name: (u.scheduled, u.first, u.last, u.bfirst) for u in engine.units if u.outer}
    return out


def gathered_at_points(steps: int = 3) -> list[dict]:
    """Stage 3, :class:`TinyGPT` with 4 blocks, ``steps`` steps: which outer units are gathered (or being
    gathered) when each block's forward begins and when each block's backward
    begins; and the most parameter bytes gathered at once (outer, root and listed units together), per step."""
    engine = _engine(3)
    model = engine.module
    watched = {name: getattr(model, name).weight for name in ("wte", "ln_f", "head")}
    record: list[tuple[str, list[str]]] = []
    top = {"bytes": 0}

    def now(tag: str) -> None:  # whole: the storage holds every element (at rest: a 1-element placeholder)
        with torch._C.DisableTorchFunctionSubclass():  # not a use of the values (Note [Parameters at rest])
            record.append((tag, [n for n, p in watched.items() if p.untyped_storage().nbytes() >= p.nbytes]))

    def bytes_gathered() -> int:
        return sum(b.data.untyped_storage().nbytes() for u in engine.units if not u.persistent for b in u.buffers)

    gather = engine._gather

    def counting_gather(unit, wait=True):
        gather(unit, wait)
        top["bytes"] = max(top["bytes"], bytes_gathered())

    engine._gather = counting_gather
    for i, block in enumerate(engine.module.blocks):
        block.register_forward_pre_hook(lambda m, a, i=i: now(f"forward {i}") if torch.is_grad_enabled() else None)
        block.register_full_backward_pre_hook(lambda m, g, i=i: now(f"backward {i}"))
    out = []
    for ids in _batches(steps, 1):
        record.clear()
        top["bytes"] = 0
        engine.backward(engine((ids, None)))
        engine.step()
        out.append({"points": list(record), "max_bytes": top["bytes"]})
    sizes = {name: p.nbytes for name, p in watched.items()}
    return {"steps": out, "sizes": sizes}
