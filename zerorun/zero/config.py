"""The engine's configuration: how it partitions, communicates and accumulates."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from zerorun.zero.precision import DTYPES, LossScaleConfig

#: ``ZeroConfig.keep_root_bytes``'s default: 1 MiB (Note [Kept from forward to backward] in stage3_outer.py).
KEEP_ROOT_BYTES = 2**20


def _finite(value) -> bool:
    """Whether ``value`` is an int or float (not a bool) and finite."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class ZeroConfig:
    """How the engine partitions and communicates.

    Attributes:
        stage: 0 (replicated, DDP-equivalent), 1 (optimizer states), 2 (+ gradients) partitioned.
        bucket_mb: size of one flat buffer (the unit of communication) in MiB (2**20 bytes).
        grad_accum_steps: micro-steps per optimizer step; ``backward`` scales the loss by ``1 / grad_accum_steps``.
        grad_clip: clip the global gradient L2 norm to this value; ``None`` or ``0`` for no clipping.
        units: stage 3: the modules gathered and freed as one unit each: class names (``("Block",)``: every
            module of that class) or modules' qualified names (``"transformer.wte"``); empty to let zerorun
            pick units by parameter count (Note [Units] in stage3.py).
        activation_checkpointing: stage 3: recompute each unit's forward in backward
            (``torch.utils.checkpoint``, non-reentrant) instead of keeping its activations.
        prefetch: stage 3: all-gather the next unit (in the order recorded in the last pass that differed)
            while the current one computes; False: none, whatever ``prefetch_bytes`` says.
        prefetch_bytes: stage 3, with ``prefetch``: the most bytes of units gathered ahead of the one in use
            (DeepSpeed's ``stage3_prefetch_bucket_size``, in bytes): the units that follow in the recorded order
            are all-gathered while their gathered bytes sum to at most this; 0 for none; ``None`` (default):
            the next unit, whatever its size (Note [Prefetch] in ``stage3.py``).
        persistence_threshold: stage 3: parameters of at most this many elements stay whole on every rank
            (Note [Persistent parameters] in ``stage3.py``); 0 for none.
        keep_root_bytes: stage 3: where the root unit and every outer unit (a GPT's embeddings, final norm and LM
            head) hold at most this many bytes together when gathered (default 1 MiB), they are all-gathered once
            per micro-step and stay gathered from the end of a forward with gradients on into its backward: one
            all-gather fewer per micro-step and no saved-tensor hooks, for those bytes held through the loss's
            backward; so does the forward's last listed unit (the first of backward) where it fits with them; 0:
            freed after every forward (Note [Kept from forward to backward] in ``stage3_outer.py``).
        precision: ``"fp32"``, ``"bf16"`` or ``"fp16"``: dtype of parameters, gradients and collectives; fp32
            master slices and optimizer states either way (Note [Mixed precision] in ``precision.py``).
        reduce_dtype: ``None`` (reduce gradients in ``precision``) or ``"fp32"`` (reduce an fp32 copy).
        loss_scale: fp16 dynamic loss scaling (Note [Loss scaling]).
        offload_optimizer: ``"none"``, ``"cpu"`` or ``"disk"``: where master slices and optimizer states
            live and the step runs (``offload.py``).
        offload_params: stage 3: ``"none"`` or ``"disk"``: this rank's parameter slices in a file under
            ``offload_path``, in memory only while their unit is all-gathered or stepped (Note [Parameter
            offload] in ``param_offload.py``; CPU devices).
        offload_path: ``disk``: folder for the swap files (created if missing).
        offload_buffer_mb: ``disk``: host buffer through which they are paged, in MiB.
        grad_accum_dtype: ``"fp32"``, ``"bf16"``, ``"fp16"`` or ``None``: dtype in which micro-step gradients
            are summed (DeepSpeed's ``data_types.grad_accum_dtype``). ``None``: fp32 when ``grad_accum_steps``
            > 1 and ``precision`` is bf16 or fp16 (summing 2-byte gradients loses the low bits: 64 bf16
            micro-steps err 7e-3 relative against 2e-4 in fp32), else ``precision``. Memory: stages 0-1 keep
            a full accumulator of this dtype beside the gradients (4Ψ bytes for fp32); stages 2-3 keep their
            gradient slice in it (4Ψ/N).
        hierarchy: stage 3: ZeRO++'s hierarchical partitioning (hpZ, Note [Secondary shards] in
            ``hierarchy.py``): ``"node"`` (a secondary shard over the ranks of each node, from the launch plan) or
            a number of consecutive ranks (DeepSpeed's ``zero_hpz_partition_size``); the gradients are then
            reduce-scattered in two levels, within those ranks first (Note [Two-level reduce-scatter]);
            ``None``: flat.
        quantize_weights: stage 3: ``"int8"``: parameters all-gathered from their shards as int8 blocks with
            an fp32 scale each (ZeRO++'s qwZ, Note [Quantized weights] in ``quantize.py``); ``None``: exact.
        quantize_grads: stages 1-3: ``"int8"`` or ``"int4"``: the gradients' reduce-scatter as an all-to-all of
            blocks of that width with an fp32 scale each, summed in fp32 on arrival, within the node first where
            the ranks run on several nodes (ZeRO++'s qgZ, Note [Quantized gradients] in
            ``quantized_grads.py``); ``None``: exact.
        quantize_block: elements per scale of ``quantize_weights`` and ``quantize_grads``.
        broadcast_buffers: before every training forward (module in training mode, grad enabled), copy rank
            0's module buffers (BatchNorm's running statistics) to every rank, coalesced (DDP's option, name
            and default; Note [Coalesced broadcasts] in ``broadcast.py``). False: each rank keeps its own.
            The setup broadcast of parameters and buffers happens either way.
    """

    stage: int = 0
    bucket_mb: float = 25.0
    grad_accum_steps: int = 1
    grad_clip: float | None = None
    units: tuple[str, ...] = ()
    activation_checkpointing: bool = False
    prefetch: bool = True
    prefetch_bytes: int | None = None
    persistence_threshold: int = 0
    keep_root_bytes: int = KEEP_ROOT_BYTES
    precision: str = "fp32"
    reduce_dtype: str | None = None
    loss_scale: LossScaleConfig = LossScaleConfig()
    offload_optimizer: str = "none"
    offload_params: str = "none"
    offload_path: str | None = None
    offload_buffer_mb: float = 64.0
    grad_accum_dtype: str | None = None
    broadcast_buffers: bool = True
    hierarchy: int | str | None = None
    quantize_weights: str | None = None
    quantize_grads: str | None = None
    quantize_block: int = 256

    def __post_init__(self) -> None:
        if isinstance(self.stage, bool) or self.stage not in (0, 1, 2, 3):
            raise ValueError(f"zero.stage must be 0, 1, 2 or 3, got {self.stage!r}")
        self._check_types()
        if self.precision not in DTYPES:
            raise ValueError(f"precision must be fp32, bf16 or fp16, got {self.precision!r}")
        if self.reduce_dtype not in (None, "fp32"):
            raise ValueError(f"zero.reduce_dtype must be fp32 or unset, got {self.reduce_dtype!r}")
        if self.offload_optimizer not in ("none", "cpu", "disk"):
            raise ValueError(f"zero.offload_optimizer must be none, cpu or disk, got {self.offload_optimizer!r}")
        if self.offload_optimizer == "disk" and not self.offload_path:
            raise ValueError("zero.offload_optimizer disk needs zero.offload_path (a folder for the swap files)")
        if self.offload_params not in ("none", "disk"):
            raise ValueError(f"zero.offload_params must be none or disk, got {self.offload_params!r}")
        if self.offload_params == "disk" and (self.stage != 3 or not self.offload_path):
            raise ValueError("zero.offload_params disk needs zero.stage 3 (parameters partitioned) and "
                             "zero.offload_path (a folder for the swap files)")
        if self.prefetch_bytes is not None and (isinstance(self.prefetch_bytes, bool)
                                                or not isinstance(self.prefetch_bytes, int) or self.prefetch_bytes < 0):
            raise ValueError(f"zero.prefetch_bytes must be an integer >= 0 or unset, got {self.prefetch_bytes!r}")
        if self.grad_accum_dtype not in (None, "fp32", "bf16", "fp16"):
            raise ValueError(f"zero.grad_accum_dtype must be fp32, bf16, fp16 or unset, got {self.grad_accum_dtype!r}")
        if self.hierarchy is not None:
            self._check_hierarchy()
        if self.quantize_weights not in (None, "int8"):
            raise ValueError(f"zero.quantize_weights must be int8 or unset, got {self.quantize_weights!r}")
        if self.quantize_weights and self.stage != 3:
            raise ValueError(f"zero.quantize_weights: parameters are all-gathered (and quantized on the way) at "
                             f"stage 3; this is stage {self.stage}: set zero.stage 3 or remove it")
        if self.quantize_grads not in (None, "int8", "int4"):
            raise ValueError(f"zero.quantize_grads must be int8, int4 or unset, got {self.quantize_grads!r}")
        if self.quantize_grads and self.stage == 0:
            raise ValueError("zero.quantize_grads quantizes the gradients' reduce-scatter of stages 1-3; stage 0 "
                             "all-reduces them as DDP does: set zero.stage 1, 2 or 3 or remove it")
        if self.activation_checkpointing and self.stage != 3:
            raise ValueError(f"activation_checkpointing recomputes each stage-3 unit's forward in backward; this is "
                             f"stage {self.stage}: set zero.stage 3, or apply torch.utils.checkpoint in the model")

    def _check_types(self) -> None:
        """The numbers, flags and names: a wrong type is one line naming the field (before: a string bucket size
        was a TypeError from a comparison, 2.5 accumulation steps could never step, a negative or NaN
        ``grad_clip`` flipped or poisoned every gradient, ``units="Block"`` was read as its letters)."""
        for name in ("bucket_mb", "offload_buffer_mb"):
            if not _finite(getattr(self, name)) or getattr(self, name) <= 0:
                raise ValueError(f"zero.{name} must be a number > 0, got {getattr(self, name)!r}")
        for name, least in (("grad_accum_steps", 1), ("persistence_threshold", 0), ("keep_root_bytes", 0),
                            ("quantize_block", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"zero.{name} must be an integer >= {least}, got {value!r}")
        if self.grad_clip is not None and (not _finite(self.grad_clip) or self.grad_clip < 0):
            raise ValueError(f"zero.grad_clip must be a number >= 0 (0: no clipping) or unset, got {self.grad_clip!r}")
        for name in ("activation_checkpointing", "prefetch", "broadcast_buffers"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"zero.{name} must be true or false, got {getattr(self, name)!r}")
        units = (self.units,) if isinstance(self.units, str) else self.units  # one name
        if not isinstance(units, (tuple, list)) or not all(isinstance(u, str) and u for u in units):
            raise ValueError(f"zero.units must be a list of module class names or qualified names, got {units!r}")
        object.__setattr__(self, "units", tuple(units))

    def _check_hierarchy(self) -> None:
        h = self.hierarchy
        if h != "node" and (isinstance(h, bool) or not isinstance(h, int) or h < 2):
            raise ValueError(f"zero.hierarchy must be node or a number of ranks >= 2, got {h!r}")
        if self.stage != 3:
            raise ValueError(f"zero.hierarchy: hierarchical partitioning (hpZ) shards parameters, which stage 3 "
                             f"does; this is stage {self.stage}: set zero.stage 3 or remove zero.hierarchy")
        if self.offload_params != "none":
            raise ValueError("zero.hierarchy keeps a secondary shard of the parameters in memory; "
                             "zero.offload_params disk keeps them on disk: use one of them")

    @property
    def accum_dtype(self) -> torch.dtype:
        """The resolved ``grad_accum_dtype`` (see there)."""
        if self.grad_accum_dtype is not None:
            return DTYPES[self.grad_accum_dtype]
        if self.grad_accum_steps > 1 and self.precision in ("bf16", "fp16"):
            return torch.float32
        return DTYPES[self.precision]
