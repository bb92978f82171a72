"""The recipe's training sections: ``train`` (steps, micro-batches, optimizer, schedule), ``zero`` (stage,
buckets, stage-3 units, offload) and ``loss_scale`` (fp16)."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

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
    name: str = "AdamW"
    lr: float = Field(3e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    decay_1d: bool = False
    elementwise: bool = False

    def kwargs(self) -> dict[str, Any]:
        """Keyword arguments for the optimizer class, ``weight_decay`` included (split into groups later)."""
        return {k: v for k, v in self.model_dump().items() if k not in ("name", "decay_1d", "elementwise")}


class ScheduleSpec(Strict):
    """Learning-rate multiplier: linear warm-up over ``warmup_steps``, then ``cosine``/``linear`` decay to
    ``min_lr_ratio`` at the last step, or ``constant``."""

    warmup_steps: int = Field(0, ge=0)
    decay: Literal["cosine", "linear", "constant"] = "cosine"
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0)


class TrainSpec(Strict):
    """Optimizer steps, per-rank micro-batch size (samples), gradient accumulation steps, clipping, seed and
    evaluation cadence (``eval_every`` steps, 0 for never; ``eval_batches`` micro-batches per rank)."""

    steps: int = Field(gt=0)
    micro_batch_size: int = Field(gt=0)
    grad_accum_steps: int = Field(1, gt=0)
    optimizer: OptimizerSpec = Field(default_factory=OptimizerSpec)
    schedule: ScheduleSpec = Field(default_factory=ScheduleSpec)
    grad_clip: float | None = Field(None, ge=0)
    seed: int = 1234
    eval_every: int = Field(0, ge=0)
    eval_batches: int = Field(8, gt=0)
    activation_checkpointing: bool = False


class ZeroSpec(Strict):
    """ZeRO stage (0 = DDP-equivalent), bucket size in MiB; stage 3: units (module class names gathered and
    freed as one; empty: chosen by parameter count), prefetch of the next unit (or of the units within
    ``prefetch_bytes``), and whether the model is
    built on the meta device so that no rank ever holds all of it (``meta_init``)."""

    stage: Literal[0, 1, 2, 3] = 0
    bucket_mb: float = Field(25.0, gt=0)
    units: list[str] = Field(default_factory=list)
    prefetch: bool = True
    # Stage 3: the most bytes of units all-gathered ahead of the one in use (unset: the next unit; 0: none).
    prefetch_bytes: int | None = Field(None, ge=0)
    meta_init: bool = True
    # Stage 3: parameters of at most this many elements stay whole on every rank (0: none).
    persistence_threshold: int = Field(0, ge=0)
    # Mixed precision and offload (zerorun/zero/precision.py, offload.py): reduce gradients in fp32 instead of
    # the 2-byte precision; where the fp32 master slices and optimizer states live (none | cpu | disk), the
    # folder for disk's swap files and the host buffer (MiB) they are paged through.
    reduce_dtype: Literal["fp32"] | None = None
    offload_optimizer: Literal["none", "cpu", "disk"] = "none"
    offload_params: Literal["none", "disk"] = "none"  # stage 3: parameter slices in a file (param_offload.py)
    offload_path: str | None = None
    offload_buffer_mb: float = Field(64.0, gt=0)
    # Dtype in which micro-step gradients are summed (DeepSpeed's name): None = fp32 when
    # train.grad_accum_steps > 1 and precision is bf16/fp16, else the parameters' dtype (ZeroConfig).
    grad_accum_dtype: Optional[Literal["fp32", "bf16", "fp16"]] = None
    # Copy rank 0's module buffers (BatchNorm statistics) to every rank before each training forward (DDP's
    # broadcast_buffers; zerorun/zero/config.py). false: each rank keeps its own.
    broadcast_buffers: bool = True


class LossScaleSpec(Strict):
    """fp16 dynamic loss scaling (Note [Loss scaling] in zerorun/zero/precision.py): the first scale, good
    steps before it grows by ``growth_factor``, the factor applied on overflow, and its floor."""

    initial_scale: float = Field(65536.0, gt=0)
    growth_interval: int = Field(2000, gt=0)
    backoff: float = Field(0.5, gt=0, lt=1)
    min_scale: float = Field(1.0, gt=0)
    growth_factor: float = Field(2.0, gt=1)
