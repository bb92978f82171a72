"""What ``zerorun import-deepspeed`` (deepspeed.py) knows of DeepSpeed's fields: the ZeRO fields zerorun always
behaves as if set, the optimizer params carried into the recipe's ``train.optimizer``, and ZeRO++'s fields."""

from __future__ import annotations

import json

from zerorun.errors import ZerorunError

#: fields zerorun always behaves as if set, or has no use for, with the reason given when dropped
ALWAYS = {
    "overlap_comm": "always on (reduce-scatter overlaps backward at stages 2-3)",
    "contiguous_gradients": "always on (flat buffers)",
    "reduce_scatter": "always on at stages 2-3",
    "allgather_partitions": "always on",
    "allgather_bucket_size": "zerorun all-gathers per flat buffer / stage-3 unit",
    "stage3_max_live_parameters": "stage 3 holds the gathered units and those prefetched (zero.prefetch_bytes)",
    "stage3_max_reuse_distance": "stage 3 frees a unit after its forward and its backward",
    "stage3_gather_16bit_weights_on_model_save": "zerorun consolidate writes full weights from any checkpoint",
    "round_robin_gradients": "no equivalent",
    "sub_group_size": "disk offload pages through zero.offload_buffer_mb instead",
}


_ADAM = {"lr": float, "weight_decay": float, "eps": float, "amsgrad": bool, "maximize": bool}
#: DeepSpeed's optimizer params carried into the recipe, per torch.optim class (the same name and meaning there):
#: name -> float or bool.
CARRIED = {"Adam": {**_ADAM, "decoupled_weight_decay": bool}, "AdamW": _ADAM,
            "SGD": {"lr": float, "weight_decay": float, "momentum": float, "dampening": float, "nesterov": bool,
                    "maximize": bool},
            "Adagrad": {"lr": float, "weight_decay": float, "eps": float, "lr_decay": float,
                        "initial_accumulator_value": float, "maximize": bool}}
#: DeepSpeed's optimizer params that choose an implementation, not the update.
_IMPLEMENTATION = ("torch_adam", "fused", "foreach", "capturable", "differentiable")


def not_carried(key: str, name: str) -> str:
    """Why DeepSpeed's optimizer param ``key`` is dropped from a recipe whose optimizer is ``torch.optim.name``."""
    if key in _IMPLEMENTATION:
        return f"chooses an implementation; zerorun's ranks run torch.optim.{name}"
    if key == "bias_correction" and name in ("Adam", "AdamW"):
        return f"torch.optim.{name} always corrects the bias"
    return f"not an argument of torch.optim.{name}"


def zero_plus_plus(imp, z: dict, out: dict) -> None:
    """ZeRO++'s fields of the config's ``zero_optimization`` ``z`` (taken out of it) into the recipe's ``zero``
    ``out``, through the importer ``imp`` (deepspeed.py): ``zero_hpz_partition_size`` N > 1 is ``zero.hierarchy:
    N`` (ranks per secondary group, Note [Secondary shards] in zero/hierarchy.py; stage 3 only), 1 nothing;
    ``zero_quantized_weights`` true is ``zero.quantize_weights: int8`` (stage 3 only);
    ``zero_quantized_gradients`` true is ``zero.quantize_grads: int4``, the width DeepSpeed's qgZ sends, at stage 3
    (DeepSpeed's stages 1-2 never read it: there it is listed as dropped; Note [Quantized gradients] in
    zero/quantized_grads.py); false nothing.

    Raises:
        ZerorunError: a size that is not an integer >= 1, or that does not divide the hostfile's ranks; a
            quantization switch that is not true or false (one line naming the field).
    """
    field = "zero_optimization.zero_hpz_partition_size"
    size = imp.num(field, z.pop("zero_hpz_partition_size"), int) if "zero_hpz_partition_size" in z else None
    if size is not None and size < 1:
        raise ZerorunError(f"{field}: expected a number of ranks >= 1, got {size}")
    if size is not None and size > 1 and imp.world and (size >= imp.world or imp.world % size):
        raise ZerorunError(f"{field}: {size} must divide the hostfile's {imp.world} ranks and be below it")
    if size is not None and size > 1:
        if out.get("stage") == 3 and out.get("offload_params") != "disk":
            out["hierarchy"] = size
        elif out.get("stage") == 3:  # the recipe check refuses both: the offloaded parameters are kept
            imp.drop(field, "its secondary shard lives in memory; offload_param nvme keeps the parameters on disk "
                            "(zero.offload_params: disk)")
        else:
            imp.drop(field, "stage 3 only (zero.hierarchy)")
    key = "zero_quantized_weights"  # §3.1: Note [Quantized weights] in zero/quantize.py
    if key in z and imp.flag(f"zero_optimization.{key}", z.pop(key)):
        if out.get("stage") == 3:
            out["quantize_weights"] = "int8"
        else:
            imp.drop(f"zero_optimization.{key}", "stage 3 only (zero.quantize_weights)")
    key = "zero_quantized_gradients"  # §3.3
    if key in z and imp.flag(f"zero_optimization.{key}", z.pop(key)):
        if out.get("stage") == 3:
            out["quantize_grads"] = "int4"
        else:  # DeepSpeed's stages 1-2 never read it: they trained exact, as the import does
            imp.drop(f"zero_optimization.{key}", "DeepSpeed applies it at stage 3 only (zero.quantize_grads takes "
                                                 "stages 1-3: set it to quantize here)")


def parse_config(path: str, text: str) -> dict:
    """The DeepSpeed config at ``path`` (its ``text``) read as DeepSpeed reads it: Hjson where it is not JSON
    (comments and trailing commas, which DeepSpeed takes; refused before a review), a duplicate key refused,
    every top-level section's ``enabled`` read as DeepSpeed's pydantic models read it (``"true"`` and ``1`` are
    true; before, only JSON's ``true`` was, and ``"fp16": {"enabled": "true"}`` trained in fp32 without a word).

    Raises:
        ZerorunError: an empty file, not Hjson/JSON (naming the line), a duplicate key, not an object, an
            ``enabled`` that is not a boolean (one line naming the file and the field).
    """
    import hjson
    from pydantic import TypeAdapter, ValidationError

    def no_duplicates(pairs: list) -> dict:
        keys = [k for k, _ in pairs]
        twice = sorted({k for k in keys if keys.count(k) > 1})
        if twice:  # DeepSpeed: "Duplicate key in DeepSpeed config"
            raise ZerorunError(f"{path}: {twice[0]}: duplicate key (DeepSpeed refuses it too)")
        return dict(pairs)

    if not text.strip():
        raise ZerorunError(f"{path}: empty file: a DeepSpeed config is a JSON object")
    try:  # JSON first: its Infinity and NaN reach the fields' own checks, which name them
        ds = json.loads(text, object_pairs_hook=no_duplicates)
    except json.JSONDecodeError as e:
        try:
            ds = hjson.loads(text, object_pairs_hook=no_duplicates)
        except (ValueError, OverflowError) as h:  # HjsonDecodeError is a ValueError; 1e999 overflows
            line, msg = max((e.lineno, e.msg), (getattr(h, "lineno", 0), getattr(h, "msg", str(h))))
            raise ZerorunError(f"{path}:{line}: not valid JSON: {msg}") from None  # where the reader got farther
    if not isinstance(ds, dict):
        raise ZerorunError(f"{path}: a DeepSpeed config is a JSON object")
    for name, section in ds.items():
        if isinstance(section, dict) and "enabled" in section and section["enabled"] != "auto":
            try:
                section["enabled"] = TypeAdapter(bool).validate_python(section["enabled"])
            except ValidationError:
                raise ZerorunError(f"{path}: {name}.enabled: expected true or false, got "
                                   f"{section['enabled']!r}") from None
    return ds
