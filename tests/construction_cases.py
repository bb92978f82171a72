"""Cases run on every rank of a :class:`distributed.RankPool` for tests/test_construction.py: stage 3 from
``deferred_init`` against normal construction and stage 0."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

import construction_models as models
from zerorun.zero import ZeroConfig, deferred_init, initialize


def _stage3(model: nn.Module, units=()) -> object:
    return initialize(model, optimizer="AdamW", optimizer_kwargs={"lr": 1e-3, "weight_decay": 0.0},
                      config=ZeroConfig(stage=3, units=tuple(units)))


def _mismatches(full: dict, ref: dict) -> list[str]:
    return [k for k in ref if k not in full or full[k].dtype != ref[k].dtype or not torch.equal(full[k], ref[k])]


def _forms() -> list[str]:
    bad = []
    for build in (models.data_forms, models.factory_forms, models.in_place_after):
        torch.manual_seed(3)
        ref = build().state_dict()
        torch.manual_seed(3)
        engine = _stage3(deferred_init(build))
        bad += [f"{build.__name__}.{k}" for k in _mismatches(engine.full_state_dict(rank0_only=False), ref)]
    return bad


def _random_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(5, 7), nn.GELU(), nn.Linear(7, 3))


class _RankConstant(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.scale = nn.Parameter(torch.tensor([float(dist.get_rank()) + 1.0]))  # differs per rank


def _llama_batches(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    return torch.randint(0, 97, (2, 9), generator=g)


def construction_suite() -> dict:
    """Every construction check of tests/test_construction.py that needs ranks, on one pool call."""
    out: dict = {"forms": _forms()}

    torch.manual_seed(dist.get_rank())  # a rank-dependent seed before building (e.g. seeded for dropout)
    engine = _stage3(deferred_init(_random_mlp))
    torch.manual_seed(0)
    ref = _random_mlp().state_dict()
    out["seed_by_rank"] = {"equal_to_rank0": _mismatches(engine.full_state_dict(rank0_only=False), ref) == []}

    try:
        _stage3(deferred_init(_RankConstant))
        out["constant_by_rank"] = "no error"
    except RuntimeError as e:
        out["constant_by_rank"] = str(e)

    torch.manual_seed(0)
    normal = models.hf_llama()
    ref = {k: v.clone() for k, v in normal.state_dict().items()}
    torch.manual_seed(0)
    meta = deferred_init(models.hf_llama)
    opt = {"lr": 1e-3, "weight_decay": 0.0}
    e0 = initialize(normal, optimizer="AdamW", optimizer_kwargs=opt, config=ZeroConfig(stage=0))
    e3 = initialize(meta, optimizer="AdamW", optimizer_kwargs=opt,
                    config=ZeroConfig(stage=3, units=("LlamaDecoderLayer",)))
    out["llama_init_equal"] = _mismatches(e3.full_state_dict(rank0_only=False), ref) == []
    torch.manual_seed(1)
    tied = _stage3(deferred_init(models.hf_llama, tie_word_embeddings=True), units=("LlamaDecoderLayer",))
    torch.manual_seed(1)
    tied_ref = models.hf_llama(tie_word_embeddings=True)
    full = tied.full_state_dict(rank0_only=False)
    out["llama_tied_init_equal"] = _mismatches(full, tied_ref.state_dict()) == []
    fresh = models.hf_llama(tie_word_embeddings=True)  # the gathered weights load into a fresh HF model
    fresh.load_state_dict(full, strict=True)
    out["llama_tied_loads"] = fresh.lm.lm_head.weight is fresh.lm.model.embed_tokens.weight and \
        torch.equal(fresh.lm.lm_head.weight, tied_ref.lm.lm_head.weight)
    tied.close()
    losses = []
    for step in range(3):
        batch = _llama_batches(step)
        pair = []
        for engine in (e0, e3):
            loss = engine(batch)
            engine.backward(loss)
            engine.step()
            pair.append(float(loss))
        losses.append(pair)
    out["llama_losses"] = losses
    full0, full3 = e0.state_dict(), e3.full_state_dict(rank0_only=False)
    out["llama_final_rel"] = max(float((full3[k] - full0[k]).abs().max() / full0[k].abs().max().clamp_min(1e-12))
                                 for k in full0 if full0[k].is_floating_point())
    for engine in (e0, e3):
        engine.close()
    return out
