"""The recipe's training sections: ``train`` (steps, micro-batches, optimizer, schedule), ``zero`` (stage,
buckets, stage-3 units, offload) and ``loss_scale`` (fp16)."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

from zerorun.recipe.values import Strict, optimizer_argument, refuse_bool


class OptimizerSpec(BaseModel):
    """``name``: a ``torch.optim`` class; every other key is passed to it (``lr``, ``betas``, ...).
    ``weight_decay`` applies to tensors of 2 or more dimensions only unless ``decay_1d: true``. ``elementwise:
    true`` declares a class outside zerorun's checked list elementwise (Note [Elementwise optimizers] in
    ``zero/optimizers.py``)."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    # every other key, checked one by one (each problem on its own line, at the key's line)
    __pydantic_extra__: dict[str, Annotated[Any, AfterValidator(optimizer_argument)]]
    _no_bool_numbers = field_validator("*", mode="before")(classmethod(refuse_bool))
    name: str = Field("AdamW", description="a torch.optim class (elementwise: SGD, Adam, AdamW, ...); every key "
                      "not listed here is passed to it (betas, eps, momentum, ...)")
    lr: float = Field(3e-4, gt=0, description="the peak learning rate (train.schedule scales it)")
    weight_decay: float = Field(0.0, ge=0, description="weight decay, applied to tensors of 2 or more dimensions "
                                "only unless train.optimizer.decay_1d")
    decay_1d: bool = Field(False, description="apply weight_decay to 1-dimensional tensors (biases, norm weights) "
                           "too")
    elementwise: bool = Field(False, description="declare a class outside zerorun's checked list elementwise (a "
                              "trust-ratio, factored or matrix optimizer then trains wrongly)")

    def kwargs(self) -> dict[str, Any]:
        """Keyword arguments for the optimizer class, ``weight_decay`` included (split into groups later)."""
        return {k: v for k, v in self.model_dump().items() if k not in ("name", "decay_1d", "elementwise")}


class ScheduleSpec(Strict):
    """Learning-rate multiplier: linear warm-up over ``warmup_steps``, then ``cosine``/``linear`` decay to
    ``min_lr_ratio`` at the last step, or ``constant``."""

    warmup_steps: int = Field(0, ge=0, description="steps of linear warm-up of the learning rate from 0")
    decay: Literal["cosine", "linear", "constant"] = Field("cosine", description="the learning rate's decay after "
                                                           "warm-up, down to min_lr_ratio at the last step")
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0, description="the last step's learning rate as a fraction of "
                                "train.optimizer.lr")


class TrainSpec(Strict):
    """Optimizer steps, per-rank micro-batch size (samples), gradient accumulation steps, clipping, seed and
    evaluation cadence (``eval_every`` steps, 0 for never; ``eval_batches`` micro-batches per rank)."""

    steps: int = Field(gt=0, description="optimizer steps the job trains")
    micro_batch_size: int = Field(gt=0, description="samples per rank per micro-step")
    grad_accum_steps: int = Field(1, gt=0, description="micro-steps whose gradients are summed per optimizer step "
                                  "(global batch: micro_batch_size x grad_accum_steps x world size)")
    optimizer: OptimizerSpec = Field(default_factory=OptimizerSpec, description="the torch.optim class and its "
                                     "arguments")
    schedule: ScheduleSpec = Field(default_factory=ScheduleSpec, description="the learning-rate schedule: "
                                   "warm-up, then decay")
    grad_clip: float | None = Field(None, ge=0, description="the most global L2 norm of the gradients; larger ones "
                                    "are scaled down to it (unset or 0: no clipping)")
    seed: int = Field(1234, description="the random seed of the model's construction, the data's order and "
                      "(offset by rank) dropout")
    eval_every: int = Field(0, ge=0, description="steps between validation passes (0: never)")
    eval_batches: int = Field(8, gt=0, description="the most validation micro-batches per rank in one pass")
    activation_checkpointing: bool = Field(False, description="stage 3: recompute each unit's forward in backward "
                                           "instead of keeping its activations")


class ZeroSpec(Strict):
    """ZeRO stage (0 = DDP-equivalent), bucket size in MiB; stage 3: units (modules gathered and freed as one,
    by class or by name; empty: chosen by parameter count), prefetch of the next unit (or of the units within
    ``prefetch_bytes``), and whether the model is
    built on the meta device so that no rank ever holds all of it (``meta_init``)."""

    stage: Literal[0, 1, 2, 3] = Field(0, description="0: plain data parallel (DDP-equivalent); 1: optimizer "
                                       "states sharded; 2: and gradients; 3: and parameters")
    bucket_mb: float = Field(25.0, gt=0, description="MiB of gradients reduced in one collective (a flat bucket)")
    units: list[str] = Field(default_factory=list, description="stage 3: modules all-gathered and freed as one unit "
                             "each: class names (Block: every module of that class) or module names "
                             "(transformer.wte); empty: chosen by parameter count")
    prefetch: bool = Field(True, description="stage 3: all-gather the next unit while the current one computes")
    # Stage 3: the most bytes of units all-gathered ahead of the one in use (unset: the next unit; 0: none).
    prefetch_bytes: int | None = Field(None, ge=0, description="stage 3: the most bytes of units all-gathered "
                                       "ahead of the one in use (unset: the next unit; 0: none)")
    meta_init: bool = Field(True, description="stage 3: build the model on the meta device so that each rank "
                            "materializes only its slices")
    # Stage 3: parameters of at most this many elements stay whole on every rank (0: none).
    persistence_threshold: int = Field(0, ge=0, description="stage 3: parameters of at most this many elements "
                                       "stay whole on every rank (0: none)")
    # Stage 3: the root and the outer units (and the last unit) stay gathered from forward into backward up to these
    # bytes together.
    keep_root_bytes: int | None = Field(None, ge=0, description="stage 3: the root unit and the outer units "
                                        "(embeddings, final norm, LM head) are gathered once per micro-step and "
                                        "kept from the end of forward into backward when their bytes together are "
                                        "at most this, and the forward's last unit too where it fits with them "
                                        "(unset: 1 MiB; 0: freed after every forward)")
    # Mixed precision and offload (zerorun/zero/precision.py, offload.py): reduce gradients in fp32 instead of
    # the 2-byte precision; where the fp32 master slices and optimizer states live (none | cpu | disk), the
    # folder for disk's swap files and the host buffer (MiB) they are paged through.
    reduce_dtype: Literal["fp32"] | None = Field(None, description="reduce gradients in fp32 instead of the "
                                                 "2-byte precision (unset: in the parameters' dtype)")
    offload_optimizer: Literal["none", "cpu", "disk"] = Field("none", description="where the fp32 master slices "
                                                              "and optimizer states live: device, host memory, "
                                                              "or files under zero.offload_path")
    offload_params: Literal["none", "disk"] = Field("none", description="stage 3: keep the parameter slices in a "
                                                    "file under zero.offload_path")  # param_offload.py
    offload_path: str | None = Field(None, description="the folder of disk offload's swap files (one per rank)")
    offload_buffer_mb: float = Field(64.0, gt=0, description="MiB of host buffer that disk offload pages the "
                                     "states through")
    # Dtype in which micro-step gradients are summed (DeepSpeed's name): None = fp32 when
    # train.grad_accum_steps > 1 and precision is bf16/fp16, else the parameters' dtype (ZeroConfig).
    grad_accum_dtype: Optional[Literal["fp32", "bf16", "fp16"]] = Field(
        None, description="the dtype micro-step gradients are summed in (unset: fp32 when grad_accum_steps > 1 "
        "in bf16/fp16, else the parameters')")
    # Copy rank 0's module buffers (BatchNorm statistics) to every rank before each training forward (DDP's
    # broadcast_buffers; zerorun/zero/config.py). false: each rank keeps its own.
    broadcast_buffers: bool = Field(True, description="copy rank 0's module buffers (BatchNorm statistics) to "
                                    "every rank before each training forward (false: each keeps its own)")
    # ZeRO++'s hierarchical partitioning (Note [Secondary shards] in zerorun/zero/hierarchy.py).
    hierarchy: Union[int, str, None] = Field(
        None, description="stage 3: keep a secondary shard of the parameters within each node (node) or within "
        "groups of this many consecutive ranks, so that the backward all-gather never leaves them (ZeRO++ hpZ)")

    # ZeRO++'s quantized weights (Note [Quantized weights] in zerorun/zero/quantize.py).
    quantize_weights: Optional[Literal["int8"]] = Field(
        None, description="stage 3: all-gather the parameters as int8 blocks with a scale each (ZeRO++ qwZ); the "
        "sharded master copy stays exact, only forward and backward see the rounding")
    # ZeRO++'s quantized gradients (Note [Quantized gradients] in zerorun/zero/quantized_grads.py).
    quantize_grads: Optional[Literal["int8", "int4"]] = Field(
        None, description="stages 1-3: reduce-scatter the gradients as an all-to-all of int8 or int4 blocks with a "
        "scale each, summed in fp32 on arrival, within each node first (ZeRO++ qgZ)")
    quantize_block: int = Field(256, ge=1, description="elements per scale of zero.quantize_weights and "
                                "zero.quantize_grads")

    @field_validator("hierarchy", mode="before")
    @classmethod
    def _hierarchy(cls, value: Any) -> Any:
        if value is None or value == "node" or (type(value) is int and value >= 2):
            return value
        shown = f"a boolean ({str(value).lower()})" if isinstance(value, bool) else repr(value)
        raise PydanticCustomError("hierarchy", "expected node or a number of ranks >= 2; got {value}",
                                  {"value": shown})


class LossScaleSpec(Strict):
    """fp16 dynamic loss scaling (Note [Loss scaling] in zerorun/zero/precision.py): the first scale, good
    steps before it grows by ``growth_factor``, the factor applied on overflow, and its floor."""

    initial_scale: float = Field(65536.0, gt=0, description="the loss scale of the first step")
    growth_interval: int = Field(2000, gt=0, description="steps without overflow before the scale grows")
    backoff: float = Field(0.5, gt=0, lt=1, description="the factor the scale is multiplied by when a step "
                           "overflows (the step is skipped)")
    min_scale: float = Field(1.0, gt=0, description="the scale's floor")
    growth_factor: float = Field(2.0, gt=1, description="the factor the scale grows by after growth_interval good "
                                 "steps")
