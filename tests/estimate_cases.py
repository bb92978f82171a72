"""Cases run on every rank of a :class:`distributed.RankPool` for tests/test_estimate.py: what the running engine
reports (``memory_bytes()``, bytes sent in one optimizer step) for small models, stages and optimizers."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from parity_cases import MLP, _batch, _build, _loss
from zerorun.zero import ZeroConfig, initialize

#: (model, model kwargs, stage-3 units, optimizer, optimizer kwargs, bucket_mb, grad_accum_steps)
CONFIGS = [
    ("gpt", {}, ("Block",), "AdamW", {"lr": 1e-3}, 0.002, 1),                      # tied embedding -> root
    ("gpt", {"tie_embeddings": False}, (), "Adam", {"lr": 1e-3, "amsgrad": True}, 25.0, 2),  # automatic units
    ("mlp", {"frozen": True}, (), "SGD", {"lr": 0.1, "momentum": 0.9}, 0.0002, 1),  # frozen params, tiny buckets
    ("mlp", {"batchnorm": True}, (), "SGD", {"lr": 0.1}, 0.0002, 2),                 # no optimizer state
]


def build(model: str, model_kwargs: dict) -> nn.Module:
    """The model of a config, on the current default device (``torch.device("meta")`` in the test)."""
    if model == "gpt":
        return _build("gpt", 0, **model_kwargs)
    torch.manual_seed(0)
    return MLP(**model_kwargs)


def engine_reports(stage: int) -> list[dict]:
    """For every config in ``CONFIGS``: the engine's ``memory_bytes()`` after one optimizer step and the bytes
    this rank sent during that step."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    out = []
    for model, model_kwargs, units, opt, opt_kwargs, bucket_mb, accum in CONFIGS:
        m = build(model, model_kwargs)
        engine = initialize(m, optimizer=opt, optimizer_kwargs=dict(opt_kwargs),
                            config=ZeroConfig(stage=stage, bucket_mb=bucket_mb, units=units if stage == 3 else (),
                                              grad_accum_steps=accum))
        sent0 = engine.comm_stats()["bytes_sent"]
        for micro in range(accum):
            engine.backward(_loss(engine(_batch(model, 0, micro, rank, world_size, "never"))))
        engine.step()
        out.append({"bytes": engine.memory_bytes(), "sent": engine.comm_stats()["bytes_sent"] - sent0})
    return out
