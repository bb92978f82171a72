"""Mixed precision: 2-byte parameters and gradients, fp32 master slices, dynamic loss scaling for fp16.

Note [Mixed precision]: with ``precision: bf16`` or ``fp16`` the model's floating-point parameters and buffers
are cast to the 2-byte dtype once, before they are laid out in flat buffers; forward and backward run in that
dtype (no autocast: on CPU, bf16 really computes in bf16), gradients are 2-byte in the flat buffers and the
collectives move 2-byte data (``ZeroConfig.reduce_dtype = "fp32"`` reduces an fp32 copy instead). Each rank
keeps an fp32 master copy of its own slice only, and the optimizer states for that slice; after the step the
updated master slices are cast to the 2-byte dtype and all-gathered (stage 3: kept as the slice at rest). The
master is made from the 2-byte parameters (as Megatron-LM and DeepSpeed do), so every copy starts equal.
Model states per rank (ZeRO paper §3.1 and §5): 2Ψ parameters + 2Ψ gradients + KΨ optimizer (K = 12 for
Adam: the fp32 master, momentum and variance), divided over ranks by the stage.

Note [Loss scaling]: fp16 gradients underflow below 2**-24; the loss is multiplied by a scale before backward
and the gradients divided by it in fp32 before the step (Micikevicius et al., "Mixed Precision Training",
arXiv:1710.03740, §3.2). A step whose global gradient norm is not finite (an overflow on any rank, in any
slice: the squared norm is all-reduced, so every rank sees the same inf or nan) is skipped on every rank and
the scale multiplied by ``backoff`` (not below ``min_scale``); after ``growth_interval`` steps without
overflow it is multiplied by ``growth_factor``. Scales stay powers of two with the defaults, so unscaling is
exact.

Note [Wide parameters]: a floating parameter wider than fp32 (float64) keeps its dtype at every precision: a
user makes one float64 because its values need it (a large offset moved by small steps, an accumulated
statistic); cast to fp32 it trained 0.8-1.0 relative off DDP. :func:`cast_model` leaves it (and float64
module buffers) alone; ``flat.pack`` puts it in float64 flat buffers (a flat buffer is one dtype); its
gradient is reduced and accumulated in float64 whatever ``reduce_dtype`` and ``grad_accum_dtype`` say
(:func:`wide_or`); its master and optimizer states are float64 (``masters.py``, ``disk.py``: a master is fp32,
or the slice's own dtype when wider); its squares enter the global gradient norm in float64 and the norm and
clip factor are then float64, as ``clip_grad_norm_`` computes them over parameters of mixed dtypes
(``gradnorm.py``). At fp32 the model then trains equal to DDP over the same model. Under bf16/fp16 the other
floating parameters are cast as asked and float64 ones stay float64, as ``torch.autocast`` leaves float64
alone (FSDP2's ``MixedPrecisionPolicy`` keeps float64 as the sharded master too, but computes in
``param_dtype``; DeepSpeed's bf16 casts the whole module, float64 included): the model computes its float64
parts in float64, and rank 0 warns once naming each such parameter (``ZeroEngine.kept_dtypes`` lists them on
every rank). Floating inputs are still cast to the 2-byte dtype (float64 data from numpy is the common case).
Complex parameters are refused by ``initialize`` with a ValueError naming the parameter, before any
collective (:func:`refuse_complex`); integer and bool parameters, which cannot require gradients, are frozen
parameters and stay as they are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map

#: ``precision`` names and the dtype of parameters and gradients they stand for.
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class LossScaleConfig:
    """Dynamic loss scaling for fp16 (Note [Loss scaling]).

    Attributes:
        initial_scale: the first scale (a power of two keeps unscaling exact).
        growth_interval: consecutive steps without overflow before the scale grows.
        backoff: factor applied to the scale on overflow, in (0, 1).
        min_scale: the scale never goes below this.
        growth_factor: factor applied after ``growth_interval`` good steps, > 1.
    """

    initial_scale: float = 2.0 ** 16
    growth_interval: int = 2000
    backoff: float = 0.5
    min_scale: float = 1.0
    growth_factor: float = 2.0

    def __post_init__(self) -> None:
        if not self.initial_scale > 0 or not self.min_scale > 0:
            raise ValueError("loss_scale: initial_scale and min_scale must be > 0")
        if self.growth_interval < 1:
            raise ValueError(f"loss_scale.growth_interval must be >= 1, got {self.growth_interval}")
        if not 0 < self.backoff < 1:
            raise ValueError(f"loss_scale.backoff must be in (0, 1), got {self.backoff}")
        if not self.growth_factor > 1:
            raise ValueError(f"loss_scale.growth_factor must be > 1, got {self.growth_factor}")


class DynamicLossScaler:
    """The current loss ``scale`` (float) and its update rule (Note [Loss scaling])."""

    def __init__(self, config: LossScaleConfig) -> None:
        self.config = config
        self.scale = float(config.initial_scale)
        self.good_steps = 0

    def state_dict(self) -> dict[str, float | int]:
        """``{"scale": float, "good_steps": int}``: what :meth:`load_state_dict` restores (JSON-able)."""
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        """Restore the scale and the count of good steps since the last change (from :meth:`state_dict`)."""
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])

    def update(self, overflow: bool) -> None:
        """Back off after an overflowing (skipped) step; grow after ``growth_interval`` good steps in a row."""
        c = self.config
        if overflow:
            self.scale = max(self.scale * c.backoff, c.min_scale)
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps == c.growth_interval:
            self.scale *= c.growth_factor
            self.good_steps = 0


def is_wide(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` is a floating dtype wider than fp32 (float64): kept as it is (Note [Wide parameters])."""
    return dtype.is_floating_point and dtype.itemsize > 4


def wide_or(dtype: torch.dtype, other: torch.dtype) -> torch.dtype:
    """``dtype`` (a flat buffer's) when it is wide, else ``other``: the dtype its gradients are reduced and
    accumulated in, or its master kept in (``other`` fp32) (Note [Wide parameters])."""
    return dtype if is_wide(dtype) else other


def compute_dtype(dtype: torch.dtype, param_dtype: torch.dtype) -> torch.dtype:
    """The dtype the engine gives a tensor of ``dtype`` at precision ``param_dtype``: ``param_dtype`` for a
    floating dtype of at most 4 bytes, ``dtype`` itself otherwise (float64, integers, bool)."""
    return param_dtype if dtype.is_floating_point and not is_wide(dtype) else dtype


def cast_model(model: nn.Module, dtype: torch.dtype) -> dict[str, torch.dtype]:
    """Cast ``model``'s floating-point parameters (in place: the ``Parameter`` objects stay) and buffers to
    ``dtype`` (:func:`compute_dtype`): integer tensors and float64 ones (Note [Wide parameters]) are left alone.

    Returns:
        ``{name: dtype}`` of the floating parameters left in a dtype other than ``dtype`` (first name of a
        shared one), in registration order.
    """
    kept: dict[str, torch.dtype] = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dtype != compute_dtype(p.dtype, dtype):
                p.data = p.data.to(dtype)
            elif p.is_floating_point() and p.dtype != dtype:
                kept[name] = p.dtype
        for module in model.modules():
            for name, b in module._buffers.items():
                if b is not None and b.dtype != compute_dtype(b.dtype, dtype):
                    module._buffers[name] = b.to(dtype)
    return kept


def cast_and_report(model: nn.Module, dtype: torch.dtype, precision: str) -> tuple[dict[str, torch.dtype], str | None]:
    """:func:`cast_model`, and what to warn of: under bf16/fp16 the floating parameters kept in their own dtype
    (Note [Wide parameters]); at any precision those the model made in another dtype below fp32 and cast to
    ``dtype`` (bf16 layers at fp32: twice their memory, other numbers; a forward that casts its inputs to them
    fails on the dtypes: a review), naming at most five of each.

    Returns:
        ``(kept, warning)``: :func:`cast_model`'s result, and the warning's text or ``None``.
    """
    recast = {n: p.dtype for n, p in model.named_parameters()
              if p.is_floating_point() and not is_wide(p.dtype) and p.dtype not in (torch.float32, dtype)}
    kept = cast_model(model, dtype)

    def names(found: dict[str, torch.dtype]) -> str:
        listed = ", ".join(f"{n} ({str(d).removeprefix('torch.')})" for n, d in list(found.items())[:5])
        return listed + (f", ... {len(found)} in all" if len(found) > 5 else "")

    said = []
    if kept and dtype != torch.float32:
        said.append(f"precision {precision} casts the floating parameters to {dtype} except {len(kept)} kept in "
                    f"their own dtype (computed, reduced and stepped in it): {names(kept)}")
    if recast:
        said.append(f"precision {precision} casts parameters the model made in another dtype to {dtype}: "
                    f"{names(recast)} (set precision to theirs, bf16 or fp16, to train in it)")
    return kept, "; ".join(said) or None


def refuse_complex(model: nn.Module) -> None:
    """Note [Wide parameters]: raises ValueError naming ``model``'s first complex parameter, if it has one (no
    collective: every rank, built alike, raises the same)."""
    for name, p in model.named_parameters():
        if p.is_complex():
            raise ValueError(f"parameter {name!r} is {p.dtype}: zerorun's ZeRO engine does not support complex "
                             "parameters; hold it as a real parameter of shape (..., 2) (torch.view_as_real) and "
                             "take torch.view_as_complex of it in forward")


def cast_inputs(tree, dtype: torch.dtype):
    """``tree`` (tensors in nested dicts, lists, tuples) with floating-point tensors cast to ``dtype``."""
    return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, tree)
