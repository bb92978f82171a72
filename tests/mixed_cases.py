"""Cases run on every rank of a :class:`distributed.RankPool`: the engine's mixed precision (bf16, fp16) and
optimizer offload (cpu, disk) against a hand-written mixed-precision recipe over torch's DDP
(tests/test_mixed_precision.py; Note [Mixed-precision tolerances] there). The models, batches and the fp32
parity cases are in parity_cases.py.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from zerorun.zero import LossScaleConfig, ZeroConfig, default_param_groups, deferred_init, initialize

from parity_cases import _batch, _build, _groups, _loss, rel

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class MixedReference:
    """The mixed-precision recipe written out by hand over torch's DDP (the reference for the engine's
    bf16/fp16 training): the model cast to the 2-byte dtype (``nn.Module.to``), DDP all-reducing its 2-byte
    gradients, one fp32 master per parameter under a per-parameter ``torch.optim`` optimizer, gradients
    unscaled and clipped in fp32, masters cast back into the model after the step; fp16 with a dynamic loss
    scale that skips a step whose gradient norm is not finite. ``flat_norm`` sums the clipping norm over one
    flat vector instead of per parameter (another summation order, for the floor). ``reduce_fp32``: no DDP;
    each parameter's gradient is cast to fp32 and all-reduced in fp32 at the step (``zero.reduce_dtype``)."""

    def __init__(self, model: nn.Module, dtype: torch.dtype, optimizer: str, kwargs: dict, wd: float,
                 loss_scale: LossScaleConfig | None, flat_norm: bool = False, reduce_fp32: bool = False,
                 **ddp_kwargs) -> None:
        self.model, self.dtype, self.flat_norm, self.reduce_fp32 = model.to(dtype), dtype, flat_norm, reduce_fp32
        self.ddp = self.model if reduce_fp32 else DDP(self.model, **ddp_kwargs)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.master = {p: p.detach().float().clone().requires_grad_(True) for p in self.params}
        groups = [dict(g, params=[self.master[p] for p in g["params"]]) for g in _groups(self.model, "default", wd)]
        self.opt = getattr(torch.optim, optimizer)(groups, **kwargs)
        self.ls = loss_scale
        self.scale = loss_scale.initial_scale if loss_scale else 1.0
        self.good = 0

    def micro(self, batch, accum: int, sync: bool) -> float:
        batch = {k: v.to(self.dtype) if torch.is_tensor(v) and v.is_floating_point() else v
                 for k, v in batch.items()} if isinstance(batch, dict) else batch
        with (contextlib.nullcontext() if sync or self.reduce_fp32 else self.ddp.no_sync()):
            loss = _loss(self.ddp(batch))
            scaled = loss.float() * self.scale if self.ls else loss
            (scaled / accum).backward()
        return loss.item() / accum

    def step(self, clip: float | None) -> tuple[float, bool]:
        for p in self.params:
            g = (p.grad if p.grad is not None else torch.zeros_like(p)).float()
            if self.reduce_fp32:
                g /= dist.get_world_size()
                dist.all_reduce(g)
            self.master[p].grad = g / self.scale
            p.grad = None
        masters = [self.master[p] for p in self.params]
        if self.flat_norm:
            norm = torch.linalg.vector_norm(torch.cat([m.grad.reshape(-1) for m in masters]))
            if clip and torch.isfinite(norm):
                torch._foreach_mul_([m.grad for m in masters], torch.clamp(clip / (norm + 1e-6), max=1.0))
        else:
            norm = torch.nn.utils.clip_grad_norm_(masters, clip if clip else float("inf"))
        skipped = self.ls is not None and not bool(torch.isfinite(norm))
        if self.ls:
            if skipped:
                self.scale, self.good = max(self.scale * self.ls.backoff, self.ls.min_scale), 0
            else:
                self.good += 1
                if self.good == self.ls.growth_interval:
                    self.scale, self.good = self.scale * self.ls.growth_factor, 0
        if not skipped:
            self.opt.step()
            with torch.no_grad():
                for p in self.params:
                    p.copy_(self.master[p])
        for m in masters:
            m.grad = None
        return float(norm), skipped


def _model_rel(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """:func:`rel` over a whole model: max |a - b| over all elements of the tensors ``a`` / max |b| over all."""
    diff = max(float((x.double() - y.double()).abs().max()) for x, y in zip(a, b) if y.numel())
    return diff / max(max(float(y.double().abs().max()) for y in b if y.numel()), 1e-12)


def _reference_slices(engine, masters_by_name: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """The reference's fp32 masters laid out like the engine's :meth:`master_slices` (its flat buffers)."""
    out = []
    for buf, got in zip(engine.buffers, engine.master_slices()):
        flat = torch.zeros(buf.numel, dtype=torch.float32)
        for name, p in zip(buf.names, buf.params):
            s = buf.slots[p]
            flat[s.offset:s.offset + s.numel] = masters_by_name[name].reshape(-1)
        out.append(flat if got.numel() == buf.numel else buf.shard(flat))
    return out


def parity_mixed(stage: int, precision: str, model: str = "gpt", steps: int = 8, accum: int = 1,
                 clip: float | None = None, reduce_dtype: str | None = None, offload: str = "none",
                 offload_path: str | None = None, units: tuple = (), loss_scale: dict | None = None,
                 deferred: bool = False, **model_kwargs) -> dict:
    """The engine at ``precision`` (bf16 or fp16) against :class:`MixedReference`, step by step; also a
    second reference that differs only in summation order (another bucket size, all-reduce on every
    micro-step, a flat clipping norm): its distance to the first is the floor (``floor_*`` keys). Returns the
    largest relative differences of loss, grad norm, final 2-byte parameters and fp32 masters, and the
    steps each side skipped."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    dtype = _DTYPES[precision]
    kwargs = {"lr": 1e-3 if model == "gpt" else 1e-2}
    ls = LossScaleConfig(**(loss_scale or {})) if precision == "fp16" else None
    base = _build(model, 0, **model_kwargs)
    refs = [MixedReference(copy.deepcopy(base), dtype, "AdamW", kwargs, 0.1, ls, reduce_fp32=reduce_dtype == "fp32"),
            MixedReference(copy.deepcopy(base), dtype, "AdamW", kwargs, 0.1, ls, flat_norm=True,
                           bucket_cap_mb=0.0005)]
    if deferred:  # stage 3 from the meta device: each rank replays its slices, cast as they are kept
        base = deferred_init(_build, model, 0, **model_kwargs)
    engine = initialize(base, optimizer="AdamW", optimizer_kwargs=kwargs,
                        param_groups=default_param_groups(base, 0.1),
                        config=ZeroConfig(stage=stage, bucket_mb=0.002, grad_accum_steps=accum, grad_clip=clip,
                                          units=units, precision=precision, reduce_dtype=reduce_dtype,
                                          loss_scale=ls or LossScaleConfig(), offload_optimizer=offload,
                                          offload_path=offload_path))
    out = {k: 0.0 for k in ("loss", "grad_norm", "params", "masters", "floor_loss", "floor_grad_norm",
                            "floor_params", "floor_masters")}
    skips: list[list[int]] = [[], [], []]
    for step in range(steps):
        losses = [0.0, 0.0, 0.0]
        for micro in range(accum):
            batch = _batch(model, step, micro, rank, world_size, "never")
            for i, ref in enumerate(refs):
                losses[i] += ref.micro(batch, accum, sync=micro == accum - 1 or i == 1)
            zl = _loss(engine(batch))
            engine.backward(zl)
            losses[2] += zl.item() / accum
        (n0, s0), (n1, s1) = refs[0].step(clip), refs[1].step(clip)
        n2 = float(engine.step())
        for i, skipped in enumerate((s0, s1, engine.last_step_skipped)):
            if skipped:
                skips[i].append(step)
        out["loss"] = max(out["loss"], rel(losses[2], losses[0]))
        out["floor_loss"] = max(out["floor_loss"], rel(losses[1], losses[0]))
        if not s0:
            out["grad_norm"] = max(out["grad_norm"], rel(n2, n0))
            out["floor_grad_norm"] = max(out["floor_grad_norm"], rel(n1, n0))
    # Parameters and masters are compared over the whole model (_model_rel), not tensor by tensor: a bias
    # near zero whose gradient changes sign under a 2-byte rounding moves by 2 lr under Adam, which is a large
    # part of that one tensor's scale but not of the model's.
    ref_state = refs[0].model.state_dict()
    for prefix, state in (("", engine.state_dict()), ("floor_", refs[1].model.state_dict())):
        assert list(state) == list(ref_state)
        for (name, a), b in zip(ref_state.items(), state.values()):
            assert b.dtype == a.dtype == dtype or not a.is_floating_point(), (name, a.dtype, b.dtype)
        out[prefix + "params"] = _model_rel([b.float() for b in state.values()], [a.float() for a in ref_state.values()])
    names = {p: n for n, p in refs[0].model.named_parameters()}
    alt_names = {p: n for n, p in refs[1].model.named_parameters()}
    # this rank's master slices, relative to the whole reference model's largest master (as the floor is)
    scale = max(float(m.abs().max()) for m in refs[0].master.values()) / max(
        float(m.abs().max()) for m in _reference_slices(engine, {names[p]: m for p, m in refs[0].master.items()}))
    out["masters"] = _model_rel(engine.master_slices(),
                                _reference_slices(engine, {names[p]: m for p, m in refs[0].master.items()})) / scale
    alt = {alt_names[p]: m for p, m in refs[1].master.items()}
    out["floor_masters"] = _model_rel([alt[names[p]] for p in refs[0].master], list(refs[0].master.values()))
    out["skipped"] = {"ref": skips[0], "floor": skips[1], "engine": skips[2]}
    out["loss_scale"] = [refs[0].scale, engine.loss_scale]
    out["dtypes"] = sorted({str(b.data.dtype) for b in engine.buffers if b.data is not None and b.data.numel()})
    engine.close()
    return out


def overflow(stage: int, inject_step: int = 2, steps: int = 5) -> dict:
    """fp16 with one gradient element set to inf on rank 0 only, at ``inject_step`` (a hook on the token
    embedding's gradient, before any reduction). Returns per step: skipped, loss scale after the step, and
    whether the parameters and masters changed."""
    rank = dist.get_rank()
    model = _build("gpt", 0)
    engine = initialize(model, optimizer="AdamW", optimizer_kwargs={"lr": 1e-3},
                        config=ZeroConfig(stage=stage, bucket_mb=0.002, precision="fp16",
                                          units=("Block",) if stage == 3 else (),
                                          loss_scale=LossScaleConfig(initial_scale=1024.0, growth_interval=2)))
    inject = {"on": False}

    def poison(grad: torch.Tensor) -> torch.Tensor:
        if inject["on"] and rank == 0:
            grad = grad.clone()
            grad.view(-1)[0] = float("inf")
        return grad

    model.tok_emb.weight.register_hook(poison)
    rows = []
    for step in range(steps):
        inject["on"] = step == inject_step
        before = [m.clone() for m in engine.master_slices()]
        params_before = {k: v.clone() for k, v in engine.state_dict().items()}
        engine.backward(_loss(engine(_batch("gpt", step, 0, rank, dist.get_world_size(), "never"))))
        norm = float(engine.step())
        after = engine.master_slices()
        rows.append({"skipped": engine.last_step_skipped, "scale": engine.loss_scale, "finite": math.isfinite(norm),
                     "masters_changed": any(not torch.equal(a, b) for a, b in zip(after, before)),
                     "params_changed": any(not torch.equal(v, params_before[k]) for k, v in engine.state_dict().items()),
                     "adam_steps": sorted({int(s["step"]) for s in engine.masters.state_slices() if "step" in s})})
    rows.append({"skipped_steps": engine.skipped_steps})
    return rows


def offload_equal(stage: int, precision: str, offload: str, offload_path: str | None = None, steps: int = 6,
                  accum: int = 2, clip: float | None = 0.05, buffer_mb: float = 0.02) -> dict:
    """Two engines on the same batches, one without offload and one with ``offload``; the largest relative
    differences (whole model) of loss, grad norm, parameters and fp32 masters, and what the offloaded one
    holds where. ``buffer_mb`` is small so that disk pages many sub-groups."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    units = ("Block",) if stage == 3 else ()
    engines = []
    for mode in ("none", offload):
        model = _build("gpt", 0)
        engines.append(initialize(model, optimizer="AdamW", optimizer_kwargs={"lr": 1e-3, "weight_decay": 0.1},
                                  config=ZeroConfig(stage=stage, bucket_mb=0.002, grad_accum_steps=accum,
                                                    grad_clip=clip, units=units, precision=precision,
                                                    offload_optimizer=mode, offload_path=offload_path,
                                                    offload_buffer_mb=buffer_mb)))
    out = {"loss": 0.0, "grad_norm": 0.0}
    for step in range(steps):
        losses, norms = [], []
        for engine in engines:
            total = 0.0
            for micro in range(accum):
                loss = _loss(engine(_batch("gpt", step, micro, rank, world_size, "never")))
                engine.backward(loss)
                total += loss.item() / accum
            losses.append(total)
            norms.append(float(engine.step()))
        out["loss"] = max(out["loss"], rel(losses[1], losses[0]))
        out["grad_norm"] = max(out["grad_norm"], rel(norms[1], norms[0]))
    ref, off = engines
    out["params"] = _model_rel([v.float() for v in off.state_dict().values()],
                               [v.float() for v in ref.state_dict().values()])
    out["masters"] = _model_rel(off.master_slices(), ref.master_slices())
    ref_states = [t for s in ref.masters.state_slices() for k, t in sorted(s.items()) if k != "step"]
    off_states = [t for s in off.masters.state_slices() for k, t in sorted(s.items()) if k != "step"]
    out["states"] = _model_rel([torch.cat([t.reshape(-1) for t in off_states])],
                               [torch.cat([t.reshape(-1) for t in ref_states])])
    out["memory"] = {"none": ref.memory_bytes(), offload: off.memory_bytes(), "offload": off.offload_bytes()}
    out["optimizer_state_len"] = len(off.optimizer.state)
    swap = getattr(off.masters, "file", None)
    out["swap_file_existed"] = swap is not None and os.path.exists(swap.path)
    for engine in engines:
        engine.close()
    out["swap_file_after_close"] = swap is not None and os.path.exists(swap.path)
    return out
