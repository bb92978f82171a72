"""Cases run on every rank of a :class:`distributed.RankPool` for tests/test_dtypes.py: parameters that are not
fp32 (float64, complex, integer, bool) under the engine, against torch's DDP over the same model with the
same optimizer (Note [Wide parameters] in zerorun/zero/precision.py).
"""

from __future__ import annotations

import contextlib
import copy
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from checkpoint_cases import GLOBAL_BATCH, _recipe, _train, snapshot
from parity_cases import _build, rel
from zerorun import checkpoint
from zerorun.zero import LossScaleConfig, ZeroConfig, default_param_groups, initialize

#: the float64 parameters of :class:`Wide`
WIDE = ("mix", "offset")


class Wide(nn.Module):
    """fp32 layers around float64 parameters whose values need float64: ``offset`` sits near 1e8 (fp32's
    spacing there is 8) and moves by lr-sized steps; ``center`` is a float64 buffer. Also an integer and a bool
    parameter (frozen, as they must be) and, with ``frozen``, a frozen fp32 one.

    Input: ``{"x": (B, 7) fp32, "y": (B,) int64 in [0, 5)}``; output: the loss, a 0-d float64 tensor.
    """

    def __init__(self, frozen: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(7, 13)
        self.mix = nn.Parameter(torch.randn(13, 5, dtype=torch.float64) / 4)
        self.offset = nn.Parameter(1e8 + torch.randn(5, dtype=torch.float64))
        self.out = nn.Linear(5, 5)
        self.register_buffer("center", torch.full((5,), 1e8, dtype=torch.float64))
        self.count = nn.Parameter(torch.arange(3), requires_grad=False)
        self.flag = nn.Parameter(torch.tensor([True, False]), requires_grad=False)
        if frozen:
            self.inp.bias.requires_grad_(False)

    def forward(self, batch: dict) -> torch.Tensor:
        h = torch.tanh(self.inp(batch["x"]))  # written for any dtypes the engine may leave
        z = torch.tanh(h.to(self.mix.dtype) @ self.mix + (self.offset - self.center))
        logits = self.out(z.to(self.out.weight.dtype)).to(z.dtype) + z
        return F.cross_entropy(logits, batch["y"]) + 0 * self.count.sum() * self.flag.any()


class MixedBlock(nn.Module):
    """A stage-3 unit of three dtypes: a float32 ``Linear``, a float64 ``LayerNorm`` and a frozen integer
    parameter. Input and output ``(B, 16)`` fp32."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.norm = nn.Linear(16, 16), nn.LayerNorm(16, dtype=torch.float64)
        self.count = nn.Parameter(torch.arange(3), requires_grad=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.norm(torch.tanh(self.fc(h)).double()).float() + h + 0 * self.count.sum()


class MixedBlocks(nn.Module):
    """Two :class:`MixedBlock` between fp32 layers. Input as :class:`Wide`'s; output the loss (fp32)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.out = nn.Linear(7, 16), nn.Linear(16, 5)
        self.blocks = nn.ModuleList(MixedBlock() for _ in range(2))
        self.flag = nn.Parameter(torch.tensor([True, False]), requires_grad=False)

    def forward(self, batch: dict) -> torch.Tensor:
        h = self.inp(batch["x"])
        for block in self.blocks:
            h = block(h)
        return F.cross_entropy(self.out(h), batch["y"]) + 0 * self.flag.any()


class ComplexModel(nn.Module):
    """A linear layer and a complex parameter ``phase`` (never reached: initialize refuses it)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.phase = nn.Parameter(torch.randn(4, dtype=torch.complex64))


def _model(kind: str) -> nn.Module:
    """``wide`` (:class:`Wide`), ``blocks`` (:class:`MixedBlocks`) or ``gpt64`` (the tiny GPT of parity_cases,
    all float64)."""
    return Wide() if kind == "wide" else MixedBlocks() if kind == "blocks" else _build("gpt", 0).double()


def _batch(kind: str, step: int, micro: int, rank: int) -> object:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    if kind == "gpt64":
        return torch.randint(0, 61, (4, 17), generator=g)
    return {"x": torch.randn(6, 7, generator=g), "y": torch.randint(0, 5, (6,), generator=g)}


def _loss(out) -> torch.Tensor:
    return out["loss"] if isinstance(out, dict) else out


def parity(stage: int, kind: str = "wide", steps: int = 10, accum: int = 1, clip: float | None = None,
           offload: str = "none", offload_path: str | None = None, bucket_mb: float = 0.0005,
           units: tuple = ()) -> dict:
    """The engine at fp32 against DDP over the same model (its dtypes as built) with AdamW over the parameters,
    step by step. Returns the dtypes the engine left (``dtypes``: name -> dtype of every parameter;
    ``masters``: the dtypes of this rank's master slices), the largest relative differences of the loss, the
    grad norm and, per parameter dtype, the final parameters (``params``: max |a - b| / max |b| per tensor;
    ``moved``: the same of each float64 parameter's change from its initial value), and the start values
    (``start``: whether the float64 parameters still equal the model's before the first step)."""
    rank = dist.get_rank()
    ref = _model(kind)
    start = {n: p.detach().clone() for n, p in ref.named_parameters()}
    zmodel = copy.deepcopy(ref)
    kwargs = {"lr": 1e-3, "weight_decay": 0.1}
    opt = torch.optim.AdamW(default_param_groups(ref, 0.1), lr=1e-3)
    ddp = DDP(ref)
    engine = initialize(zmodel, optimizer="AdamW", optimizer_kwargs=kwargs,
                        config=ZeroConfig(stage=stage, bucket_mb=bucket_mb, grad_accum_steps=accum, grad_clip=clip,
                                          offload_optimizer=offload, offload_path=offload_path,
                                          offload_buffer_mb=0.002, units=units if stage == 3 else ()))
    out = {"dtypes": {n: str(p.dtype) for n, p in zmodel.named_parameters()},
           "masters": sorted({str(m.dtype) for m in engine.master_slices()}),
           "start": all(p.dtype == start[n].dtype and torch.equal(p, start[n])
                        for n, p in engine.full_state_dict(rank0_only=False).items() if n in start),
           "loss": 0.0, "grad_norm": 0.0, "norm_dtype": None}
    for step in range(steps):
        losses = [0.0, 0.0]
        for micro in range(accum):
            batch = _batch(kind, step, micro, rank)
            with (ddp.no_sync() if micro < accum - 1 else contextlib.nullcontext()):
                loss = _loss(ddp(batch))
                (loss / accum).backward()
            losses[0] += loss.item() / accum
            zl = _loss(engine(batch))
            engine.backward(zl)
            losses[1] += zl.item() / accum
        ref_norm = torch.nn.utils.clip_grad_norm_([p for p in ref.parameters() if p.grad is not None],
                                                  clip if clip else float("inf"))
        opt.step()
        opt.zero_grad(set_to_none=True)
        norm = engine.step()
        out["norm_dtype"] = str(norm.dtype)
        out["loss"] = max(out["loss"], rel(losses[1], losses[0]))
        out["grad_norm"] = max(out["grad_norm"], rel(float(norm), float(ref_norm)))
    got = engine.full_state_dict(rank0_only=False)
    out["params"], out["moved"] = {}, {}
    for name, want in ref.state_dict().items():
        key = str(want.dtype)
        if not want.is_floating_point():
            out.setdefault("equal_non_float", []).append(bool(torch.equal(got[name], want)))
            continue
        out["params"][key] = max(out["params"].get(key, 0.0), rel(got[name], want))
        if want.dtype == torch.float64 and name in start:
            out["moved"][name] = rel(got[name] - start[name], want - start[name])
    engine.close()
    return out


def mixed(stage: int, precision: str = "bf16", steps: int = 6) -> dict:
    """:class:`Wide` under ``precision`` against DDP over the model as the engine's Note [Wide parameters]
    describes it (fp32 parameters cast to the 2-byte dtype, float64 ones kept), one master per parameter (fp32,
    float64 for float64), an fp16 loss scale of 2**4 unscaled in the masters' dtype. Returns the dtypes, the
    warnings rank 0 gave (``warned``), ``kept_dtypes`` and the relative differences per dtype."""
    rank = dist.get_rank()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    ref = Wide()
    zmodel = copy.deepcopy(ref)
    for p in ref.parameters():
        if p.dtype == torch.float32:
            p.data = p.data.to(dtype)
    params = [p for p in ref.parameters() if p.requires_grad]
    master = {p: p.detach().to(torch.promote_types(p.dtype, torch.float32)).clone().requires_grad_(True)
              for p in params}
    groups = [dict(g, params=[master[p] for p in g["params"]]) for g in default_param_groups(ref, 0.1)]
    opt = torch.optim.AdamW(groups, lr=1e-3)
    ddp = DDP(ref)
    scale = 2.0 ** 4 if precision == "fp16" else 1.0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = initialize(zmodel, optimizer="AdamW", optimizer_kwargs={"lr": 1e-3, "weight_decay": 0.1},
                            config=ZeroConfig(stage=stage, bucket_mb=0.0005, precision=precision,
                                              loss_scale=LossScaleConfig(initial_scale=scale, growth_interval=100)))
    out = {"warned": [str(w.message) for w in caught], "kept": engine.kept_dtypes,
           "masters": sorted({str(m.dtype) for m in engine.master_slices()}),
           "dtypes": {n: str(p.dtype) for n, p in zmodel.named_parameters()}, "loss": 0.0, "params": {}}
    for step in range(steps):
        batch = _batch("wide", step, 0, rank)
        x = {"x": batch["x"].to(dtype), "y": batch["y"]}
        loss = _loss(ddp(x))
        (loss * scale).backward()
        for p in params:
            master[p].grad = p.grad.to(master[p].dtype) / scale
            p.grad = None
        opt.step()
        with torch.no_grad():
            for p in params:
                p.copy_(master[p])
        zl = _loss(engine(batch))
        engine.backward(zl)
        engine.step()
        out["loss"] = max(out["loss"], rel(zl.item(), loss.item()))
    got = engine.full_state_dict(rank0_only=False)
    for name, want in ref.state_dict().items():
        if want.is_floating_point():
            key = str(want.dtype)
            out["params"][key] = max(out["params"].get(key, 0.0), rel(got[name].double(), want.double()))
    return out


def refused(stage: int, deferred: bool = False) -> dict:
    """initialize on a model with a complex parameter: the error on this rank, then a collective that shows
    the ranks are still in step (no collective of the refused engine is pending)."""
    from zerorun.zero import deferred_init

    model = deferred_init(ComplexModel) if deferred else ComplexModel()
    try:
        initialize(model, config=ZeroConfig(stage=stage))
        error = None
    except ValueError as e:
        error = str(e)
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return {"error": error, "sum": float(t)}


def _wide_engine(stage: int, zero: dict):
    model = Wide()
    engine = initialize(model, optimizer="AdamW", optimizer_kwargs={"lr": 3e-3},
                        param_groups=default_param_groups(model, 0.1),
                        config=ZeroConfig(stage=stage, bucket_mb=0.0005, grad_clip=1.0, **zero))
    return engine, torch.optim.lr_scheduler.LambdaLR(engine.optimizer, lambda s: 0.97 ** s)


def save_and_resume(root: str, stage: int, zero: dict, resume_stage: int | None = None, save_at: int = 3,
                    steps: int = 5) -> dict:
    """Train :class:`Wide` ``steps`` steps, saving after ``save_at``; then a fresh engine (``resume_stage``,
    default the same) loads the checkpoint and trains the rest. Returns both runs' losses after the save,
    whether masters, optimizer states and float64 parameters right after the load equal those at the save
    (bit for bit) and at the end, and the masters' dtypes."""
    engine, scheduler = _wide_engine(stage, zero)
    _train(engine, scheduler, range(1, save_at + 1))
    path, _, _ = checkpoint.save(engine, root, save_at, scheduler=scheduler, position=checkpoint.DataPosition(),
                                 recipe=_recipe(), keep=1)
    saved, saved_full = snapshot(engine), engine.full_state_dict(rank0_only=False)
    losses = _train(engine, scheduler, range(save_at + 1, steps + 1))
    end, end_full = snapshot(engine), engine.full_state_dict(rank0_only=False)
    engine.close()
    same = resume_stage is None
    engine, scheduler = _wide_engine(stage if same else resume_stage, zero if same else {})
    step, _ = checkpoint.load(path, engine, scheduler=scheduler,
                              micro_batch_size=GLOBAL_BATCH // dist.get_world_size())
    loaded, loaded_full = snapshot(engine), engine.full_state_dict(rank0_only=False)
    resumed = _train(engine, scheduler, range(step + 1, steps + 1))
    out = {"path": path, "losses": losses, "resumed": resumed,
           "masters": sorted({str(m.dtype) for m in saved["masters"]}),
           "full_loaded": all(torch.equal(loaded_full[k], v) for k, v in saved_full.items()),
           "full_end": all(torch.equal(engine.full_state_dict(rank0_only=False)[k], v) for k, v in end_full.items()),
           "wide_dtypes": [str(loaded_full[n].dtype) for n in WIDE]}
    if same:
        out["masters_loaded"] = all(torch.equal(a, b) for a, b in zip(loaded["masters"], saved["masters"]))
        out["optim_loaded"] = all(torch.equal(a[k], b[k]) for a, b in zip(loaded["optim"], saved["optim"]) for k in b)
        out["masters_end"] = all(torch.equal(a, b) for a, b in zip(snapshot(engine)["masters"], end["masters"]))
    engine.close()
    return out


def engine_bytes(stage: int, precision: str = "fp32", reduce_dtype: str | None = None, offload: str = "none",
                 offload_path: str | None = None, accum: int = 1, buffer_mb: float = 0.002) -> dict:
    """:class:`Wide` after one optimizer step: ``memory_bytes()``, ``offload_bytes()`` and the bytes this rank
    sent in that step (tests/test_dtypes.py holds ``zerorun estimate``'s prediction to them)."""
    rank = dist.get_rank()
    engine = initialize(Wide(), optimizer="AdamW", optimizer_kwargs={"lr": 1e-3},
                        config=ZeroConfig(stage=stage, bucket_mb=0.0005, precision=precision, reduce_dtype=reduce_dtype,
                                          grad_accum_steps=accum, loss_scale=LossScaleConfig(2.0 ** 4),
                                          offload_optimizer=offload, offload_path=offload_path,
                                          offload_buffer_mb=buffer_mb))
    sent0 = engine.comm_stats()["bytes_sent"]
    for micro in range(accum):
        engine.backward(_loss(engine(_batch("wide", 0, micro, rank))))
    engine.step()
    out = {"bytes": engine.memory_bytes(), "offload": engine.offload_bytes(),
           "sent": engine.comm_stats()["bytes_sent"] - sent0, "skipped": engine.last_step_skipped}
    engine.close()
    return out
