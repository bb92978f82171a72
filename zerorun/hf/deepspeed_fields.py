"""What ``zerorun import-deepspeed`` (deepspeed.py) knows of DeepSpeed's fields: the ZeRO fields zerorun always
behaves as if set, and the optimizer params carried into the recipe's ``train.optimizer``."""

from __future__ import annotations

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
