"""Cross-field checks of a recipe's ``zero``, ``precision``, ``train`` and ``runtime`` fields: which engine
knobs go together (called by :func:`zerorun.recipe.load.resolve`, after paths are resolved)."""

from __future__ import annotations

import os
from typing import Callable

from zerorun.errors import ZerorunError


def check_engine_fields(recipe, where: Callable[..., str]) -> None:
    """Raise :class:`ZerorunError` (one line naming the recipe's file, line and field through ``where``, exit
    2) for engine fields that do not go together: offload without ``zero.offload_path``, stage-3 knobs at
    other stages, zerorun knobs on the DDP/FSDP2 baselines. Makes ``zero.offload_path`` absolute."""
    z = recipe.zero
    ckpt = recipe.checkpoint
    disk = [f for f in ("offload_optimizer", "offload_params") if getattr(z, f) == "disk"]
    if disk and not z.offload_path:
        raise ZerorunError(f"{where('zero', disk[0])}: disk needs zero.offload_path, a folder for the swap files")
    if z.offload_path and not disk:
        raise ZerorunError(f"{where('zero', 'offload_path')}: used by zero.offload_optimizer or "
                           "zero.offload_params disk only (both are none)")
    if z.offload_path:
        z.offload_path = os.path.abspath(os.path.expanduser(z.offload_path))
        if os.path.exists(z.offload_path) and not os.path.isdir(z.offload_path):
            raise ZerorunError(f"{where('zero', 'offload_path')}: not a directory: {z.offload_path}")
    if z.offload_params != "none" and (z.stage != 3 or recipe.runtime != "zero"):
        raise ZerorunError(f"{where('zero', 'offload_params')}: parameters are partitioned, and offloaded, at "
                           f"zerorun's zero.stage 3 only{_stage_is(recipe, where, 'offload_params', 'none')}")
    if recipe.zero.units and recipe.zero.stage != 3 and recipe.runtime != "fsdp2":
        raise ZerorunError(f"{where('zero', 'units')}: units are gathered and freed at zero.stage 3 only"
                           f"{_stage_is(recipe, where, 'units', '[]')}")
    if recipe.zero.persistence_threshold and recipe.runtime != "zero":
        raise ZerorunError(f"{where('zero', 'persistence_threshold')}: zerorun's stage 3 knob; the "
                           f"{recipe.runtime} baseline does not take it")
    if recipe.zero.persistence_threshold and recipe.zero.stage != 3:
        raise ZerorunError(f"{where('zero', 'persistence_threshold')}: parameters are partitioned, or kept whole, "
                           f"at zero.stage 3 only{_stage_is(recipe, where, 'persistence_threshold', '0')}")
    for field, what in (("prefetch_bytes", "units are prefetched (all-gathered ahead of use)"),
                        ("keep_root_bytes", "the root unit is kept gathered from forward into backward")):
        if getattr(z, field) is not None and recipe.runtime != "zero":
            raise ZerorunError(f"{where('zero', field)}: zerorun's stage 3 knob; the {recipe.runtime} "
                               "baseline does not take it")
        if getattr(z, field) is not None and z.stage != 3:
            raise ZerorunError(f"{where('zero', field)}: {what} at zero.stage 3 only"
                               f"{_stage_is(recipe, where, field, 'null')}")
    if z.prefetch_bytes is not None and not z.prefetch:
        raise ZerorunError(f"{where('zero', 'prefetch_bytes')}: set while zero.prefetch is false (nothing is "
                           "prefetched): remove one of them (zero.prefetch_bytes: 0 also prefetches nothing)")
    _check_zero_plus_plus(recipe, where)
    if recipe.runtime != "zero" and z.grad_accum_dtype is not None:
        raise ZerorunError(f"{where('zero', 'grad_accum_dtype')}: zerorun's engine knob; the {recipe.runtime} "
                           "baseline does not take it")
    if recipe.runtime != "zero" and (recipe.precision != "fp32" or z.offload_optimizer != "none"):
        field = where("precision") if recipe.precision != "fp32" else where("zero", "offload_optimizer")
        raise ZerorunError(f"{field}: the {recipe.runtime} baseline runs fp32 without offload only")
    if recipe.runtime != "zero" and ckpt.dir:
        raise ZerorunError(f"{where('checkpoint')}: checkpoints are zerorun's (runtime zero); the {recipe.runtime} "
                           "baseline does not save them")
    if recipe.model.compile and recipe.runtime != "zero":
        raise ZerorunError(f"{where('model', 'compile')}: applies to zerorun's runtime only; the {recipe.runtime} "
                           "baseline runs the model uncompiled")
    if recipe.train.activation_checkpointing and recipe.runtime != "zero":
        raise ZerorunError(f"{where('train', 'activation_checkpointing')}: applies to zerorun's stage 3 only, not "
                           f"to runtime {recipe.runtime}")
    if recipe.train.activation_checkpointing and recipe.zero.stage != 3:
        raise ZerorunError(f"{where('train', 'activation_checkpointing')}: needs zero.stage 3 (it checkpoints "
                           "each unit); at stages 0-2 wrap blocks in torch.utils.checkpoint in the model")


def _stage_is(recipe, where: Callable[..., str], field: str, off: str) -> str:
    """For a stage-3 knob set at another stage of zerorun's runtime: where that stage comes from (the recipe's
    line, or an override switching a stage-3 recipe to another stage) and how to drop the knob for it."""
    if recipe.zero.stage == 3 or recipe.runtime != "zero":
        return ""
    return (f" ({where('zero', 'stage')} is {recipe.zero.stage}): remove it for that stage (on the command line: "
            f"zero.{field}={off})")


def _check_zero_plus_plus(recipe, where: Callable[..., str]) -> None:
    """ZeRO++'s switches (docs/across-nodes.md): hpZ and qwZ at stage 3 of zerorun's runtime only, qgZ at stages
    1-3; hpZ's secondary shard in memory, not beside parameters offloaded to disk."""
    z = recipe.zero
    for field, what in (("hierarchy", "a secondary shard of the parameters (ZeRO++ hpZ)"),
                        ("quantize_weights", "quantizing the parameter all-gathers (ZeRO++ qwZ)")):
        if getattr(z, field) is not None and (recipe.runtime != "zero" or z.stage != 3):
            raise ZerorunError(f"{where('zero', field)}: {what} is zerorun's zero.stage 3 knob"
                               + (f"; the {recipe.runtime} baseline does not take it" if recipe.runtime != "zero"
                                  else ""))
    if z.quantize_grads is not None and (recipe.runtime != "zero" or z.stage == 0):
        why = (f"the {recipe.runtime} baseline does not take it" if recipe.runtime != "zero"
               else "stage 0 all-reduces them as DDP does: set zero.stage 1, 2 or 3")
        raise ZerorunError(f"{where('zero', 'quantize_grads')}: quantizes the gradients' reduce-scatter of zerorun's "
                           f"zero.stage 1-3; {why}")
    if z.hierarchy is not None and z.offload_params != "none":
        raise ZerorunError(f"{where('zero', 'hierarchy')}: keeps a secondary shard of the parameters in memory; "
                           "zero.offload_params disk keeps them on disk: use one of them")
