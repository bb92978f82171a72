"""Cases run on every rank of a :class:`distributed.RankPool` for tests/test_estimate.py: what the running engine
reports (``memory_bytes()``, bytes sent in one optimizer step) for small models, stages and optimizers."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from parity_cases import MLP, _batch, _build, _loss
from zerorun.zero import LossScaleConfig, ZeroConfig, initialize

#: (model, model kwargs, stage-3 units, optimizer, optimizer kwargs, bucket_mb, grad_accum_steps,
#: stage-3 persistence_threshold, stage-3 keep_root_bytes: None for the default, under which these models' root
#: and outer units, all small, are kept from forward to backward: Note [Kept from forward to backward])
CONFIGS = [
    # tied embedding -> root; buckets of 786 fp32 elements hold one parameter each, of 1572 2-byte ones two;
    # biases and norm weights (18-72 elements) persistent
    ("gpt", {}, ("Block",), "AdamW", {"lr": 1e-3}, 0.003, 1, 100, None),
    # automatic units; the root and the outer units freed after each forward, gathered again in its backward
    ("gpt", {"tie_embeddings": False}, (), "Adam", {"lr": 1e-3, "amsgrad": True}, 25.0, 2, 0, 0),
    # frozen params (the frozen bias persistent), tiny buckets
    ("mlp", {"frozen": True}, (), "SGD", {"lr": 0.1, "momentum": 0.9}, 0.0002, 1, 20, None),
    ("mlp", {"batchnorm": True}, (), "SGD", {"lr": 0.1}, 0.0002, 2, 0, None),                 # no optimizer state
    # a frozen token embedding: an outer unit of frozen parameters only, gathered in backward too (at its start:
    # no gradient says when); before, the estimate counted it in forward only
    ("gpt", {"tie_embeddings": False, "frozen": "tok_emb"}, ("Block",), "AdamW", {"lr": 1e-3}, 25.0, 1, 0, None),
]


def build(model: str, model_kwargs: dict) -> nn.Module:
    """The model of a config, on the current default device (``torch.device("meta")`` in the test)."""
    if model == "gpt":
        kwargs = dict(model_kwargs)
        frozen = kwargs.pop("frozen", None)
        m = _build("gpt", 0, **kwargs)
        if frozen:
            m.get_submodule(frozen).requires_grad_(False)
        return m
    torch.manual_seed(0)
    return MLP(**model_kwargs)


#: (precision, zero.reduce_dtype, zero.offload_optimizer) beyond fp32, split over world sizes 2 and 3 so that
#: each runs every stage with a few of them: mixed precision packs 2-byte buckets; offload moves the masters.
MODES = {2: [("bf16", None, "none"), ("fp16", None, "disk"), ("fp32", None, "cpu"), ("bf16", "fp32", "none")],
         3: [("fp16", None, "none"), ("bf16", None, "cpu"), ("fp32", None, "disk"), ("bf16", "fp32", "disk")]}
#: disk offload's host buffer in the cases (MiB): small, so that every slice pages through several sub-groups.
BUFFER_MB = 0.002


def engine_reports(stage: int, precision: str = "fp32", reduce_dtype: str | None = None, offload: str = "none",
                   offload_path: str | None = None, offload_params: str = "none") -> list[dict]:
    """For every config in ``CONFIGS``: the engine's ``memory_bytes()`` and ``offload_bytes()`` after two
    optimizer steps, the bytes this rank sent during the second, and whether it was skipped (fp16: the
    loss scale starts at 2**4, so the tiny models' first step does not overflow and the states exist)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    out = []
    for model, model_kwargs, units, opt, opt_kwargs, bucket_mb, accum, persistence, keep in CONFIGS:
        m = build(model, model_kwargs)
        engine = initialize(m, optimizer=opt, optimizer_kwargs=dict(opt_kwargs),
                            config=ZeroConfig(stage=stage, bucket_mb=bucket_mb, units=units if stage == 3 else (),
                                              grad_accum_steps=accum, precision=precision,
                                              reduce_dtype=reduce_dtype, loss_scale=LossScaleConfig(2.0 ** 4),
                                              offload_optimizer=offload, offload_path=offload_path,
                                              offload_params=offload_params,
                                              offload_buffer_mb=BUFFER_MB, persistence_threshold=persistence,
                                              **({} if keep is None else {"keep_root_bytes": keep})))
        for step in range(2):  # the second step's traffic: stage 3 learns its outer units' schedule in the first
            sent0 = engine.comm_stats()["bytes_sent"]
            for micro in range(accum):
                engine.backward(_loss(engine(_batch(model, step, micro, rank, world_size, "never"))))
            engine.step()
        out.append({"bytes": engine.memory_bytes(), "offload": engine.offload_bytes(),
                    "sent": engine.comm_stats()["bytes_sent"] - sent0, "skipped": engine.last_step_skipped})
        engine.close()
    return out
