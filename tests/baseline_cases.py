"""Cases run on every rank of a :class:`distributed.RankPool`: the ``zerorun bench`` baselines
(``zerorun/bench/baselines.py``) against a hand-written DDP loop."""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from parity_cases import _batch, _build, _loss, rel
from zerorun.bench import baselines
from zerorun.zero import ZeroConfig, default_param_groups


def fsdp2_vs_ddp(steps: int = 8, accum: int = 2, clip: float | None = None, units: tuple = ("Block",)) -> dict:
    """Train the tiny GPT from one seed on the same per-rank batches three ways: torch's DDP by hand (the
    reference; accumulation under ``no_sync``), the ``ddp`` and the ``fsdp2`` baseline engines. Returns the
    largest relative differences of loss and grad norm (every step) and of the final parameters against the
    reference, the smallest reference grad norm, the bytes each engine counted per step, Ψ, the FSDP2 unit names and the engines' model-state
    bytes."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    kwargs = {"lr": 1e-3, "betas": (0.9, 0.95)}
    ref_model = _build("gpt", 0)
    models = {name: copy.deepcopy(ref_model) for name in ("ddp", "fsdp2")}
    ref = DDP(ref_model, bucket_cap_mb=0.002)
    ref_opt = torch.optim.AdamW(default_param_groups(ref_model, 0.1), **kwargs)
    config = ZeroConfig(bucket_mb=0.002, grad_accum_steps=accum, grad_clip=clip, units=units)
    engines = {name: baselines.initialize(name, m, optimizer="AdamW", optimizer_kwargs=dict(kwargs),
                                          param_groups=default_param_groups(m, 0.1), config=config)
               for name, m in models.items()}
    out = {f"{name}_{key}": 0.0 for name in engines for key in ("loss", "grad_norm", "params")}
    sent = {name: [] for name in engines}
    for step in range(steps):
        ref_loss, losses = 0.0, dict.fromkeys(engines, 0.0)
        before = {name: e.comm_stats()["bytes_sent"] for name, e in engines.items()}
        for micro in range(accum):
            batch = _batch("gpt", step, micro, rank, world_size, "never")
            with (contextlib.nullcontext() if micro == accum - 1 else ref.no_sync()):
                loss = _loss(ref(batch))
                (loss / accum).backward()
            ref_loss += loss.item() / accum
            for name, engine in engines.items():
                loss = _loss(engine(batch))
                engine.backward(loss)
                losses[name] += loss.item() / accum
        ref_norm = float(torch.nn.utils.clip_grad_norm_(ref_model.parameters(), clip or float("inf")))
        out["min_ref_norm"] = min(out.get("min_ref_norm", ref_norm), ref_norm)
        ref_opt.step()
        ref_opt.zero_grad()
        for name, engine in engines.items():
            norm = float(engine.step())
            sent[name].append(engine.comm_stats()["bytes_sent"] - before[name])
            out[f"{name}_loss"] = max(out[f"{name}_loss"], rel(losses[name], ref_loss))
            out[f"{name}_grad_norm"] = max(out[f"{name}_grad_norm"], rel(norm, ref_norm))
    for name, model in models.items():
        for a, b in zip(ref_model.state_dict().values(), model.state_dict().values()):
            b = b.full_tensor() if hasattr(b, "full_tensor") else b
            out[f"{name}_params"] = max(out[f"{name}_params"], rel(b, a))
    out.update(sent=sent, psi=engines["ddp"].num_params, world_size=world_size,
               units=[u.name for u in engines["fsdp2"].units],
               memory={name: e.memory_bytes() for name, e in engines.items()})
    return out


def unknown_runtime() -> None:
    baselines.initialize("deepspeed", _build("gpt", 0))
