"""Cases run on every rank of a :class:`distributed.RankPool` for tests/test_stage3_peak.py: how many parameter
bytes stage 3 holds gathered at once (Note [Prefetch] and Note [Units outside the listed ones] in
``zerorun/zero/stage3.py``)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from parity_cases import _batch, _gpt_module, _loss
from zerorun.estimate import PRECISIONS, layout_of, working_set
from zerorun.zero import ZeroConfig, initialize

#: the test GPT: a vocabulary large beside the blocks, so that embedding and head dominate as in a real LM
SHAPE = dict(vocab_size=509, n_layer=3, n_head=2, d_model=18, max_seq_len=16)


def _module_bytes(module: torch.nn.Module, n: int) -> int:
    """fp32 bytes of ``module``'s parameters, each padded to a multiple of ``n`` elements (an upper bound on
    its flat buffers' padding)."""
    return sum(-(-p.numel() // n) * n * 4 + 4 * n for p in module.parameters())


class RootHeld(torch.nn.Module):
    """The test GPT's shape with the embedding and the head registered on the root itself as bare parameters,
    used functionally (``F.embedding``, ``F.linear``): the root unit holds them (Note [Root parameters])."""

    def __init__(self, vocab_size: int, n_layer: int, n_head: int, d_model: int, max_seq_len: int) -> None:
        super().__init__()
        gpt = _gpt_module()
        self.emb = torch.nn.Parameter(torch.randn(vocab_size, d_model) * 0.02)
        self.blocks = torch.nn.ModuleList(gpt.Block(d_model, n_head) for _ in range(n_layer))
        self.head = torch.nn.Parameter(torch.randn(vocab_size, d_model) * 0.02)

    def forward(self, batch: torch.Tensor) -> dict:
        x = F.embedding(batch[:, :-1], self.emb)
        for block in self.blocks:
            x = block(x)
        logits = F.linear(x, self.head)
        return {"loss": F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))}


def gathered_peak(tie: bool, prefetch_bytes: int | None, steps: int = 3, root_held: bool = False) -> dict:
    """Train ``steps`` steps of the test GPT at stage 3 with ``units=("Block",)`` (the embeddings, the final
    norm and the head outside every listed unit) and return the most parameter bytes this rank held gathered
    at once after the first step (sampled after every all-gather is issued: the only moment the gathered bytes
    grow), with the bound: the largest of the blocks, embeddings, final norm and head, plus the prefetch
    bound. ``prefetch_bytes=None``: prefetch off. ``root_held``: :class:`RootHeld` instead, whose root unit
    (embedding and head) is one of the units the bound takes the largest of."""
    n = dist.get_world_size()
    torch.manual_seed(0)
    if root_held:
        model = RootHeld(**SHAPE)
        root = _module_bytes(model, n) - sum(_module_bytes(b, n) for b in model.blocks)
        largest = max([root] + [_module_bytes(b, n) for b in model.blocks])
    else:
        model = _gpt_module().build_model(tie_embeddings=tie, **SHAPE)
        modules = [*model.blocks, model.tok_emb, model.pos_emb, model.ln_f, model.lm_head]
        largest = max(_module_bytes(m, n) for m in modules)
    layout = layout_of(model, bucket_mb=0.002, units=("Block",))  # what zerorun estimate counts
    options = {"prefetch": False} if prefetch_bytes is None else {"prefetch_bytes": prefetch_bytes}
    engine = initialize(model, optimizer="AdamW", optimizer_kwargs={"lr": 1e-3},
                        config=ZeroConfig(stage=3, units=("Block",), bucket_mb=0.002, **options))
    persistent = {id(b) for b in engine._persistent_unit.buffers}
    buffers = [b for b in engine.buffers + engine.frozen_buffers if id(b) not in persistent]
    comm, peak = engine._ag_comm, [0]
    issue = comm.all_gather

    def spy(output, input):
        work = issue(output, input)
        peak[0] = max(peak[0], sum(b.data.untyped_storage().nbytes() for b in buffers))
        return work

    comm.all_gather = spy
    for step in range(steps):
        if step == 1:
            peak[0] = 0  # the first step records the order; prefetch starts in the second
        engine.backward(_loss(engine(_batch("gpt", step, 0, dist.get_rank(), n, "never"))))
        engine.step()
    estimate = working_set(layout, 3, n, PRECISIONS["fp32"], prefetch=prefetch_bytes is not None,
                           prefetch_bytes=prefetch_bytes or 0).gathered
    tied = [b for b in engine.buffers if any(p is model.tok_emb.weight for p in b.params)] if tie else []
    return {"peak": peak[0], "bound": largest + (prefetch_bytes or 0), "largest": largest,
            "all": sum(b.numel * 4 for b in buffers), "tied_buffers": len(tied),
            "estimate": estimate}
