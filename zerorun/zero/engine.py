"""The ZeRO engine for stages 0, 1 and 2 (Rajbhandari et al., arXiv:1910.02054, §5).

One mechanism, the stage as policy (Note [Flat buffer layout] in ``flat.py``):

- stage 0: every rank holds full parameters, gradients and optimizer states; gradients are all-reduced
  bucket by bucket during backward (DDP-equivalent, the reference).
- stage 1: full parameters and gradients; on the last micro-step of a step gradients are reduce-scattered
  bucket by bucket during backward, each rank updates only its slice (optimizer states for the slice only),
  and the updated slices are all-gathered into the full parameters.
- stage 2: as stage 1, but on every micro-step each bucket's gradient is reduce-scattered as soon as it is
  ready and the full bucket gradient is freed: a rank keeps only its gradient slice, accumulated over
  micro-steps.

Note [Gradient buffer pool]: at stages 2-3 a bucket's full gradient exists only from its first parameter's
gradient until its reduce-scatter is done. It is taken from a pool (``comm.BufferPool``) that keeps at most
``MAX_INFLIGHT + 1`` buffers, allocated in the first backward of a step, reused by every bucket that fits and
every micro-step, and dropped when the optimizer step begins: a fresh allocation per bucket costs a page fault
per page on every use (large blocks are mmapped, Note [Returning freed memory] in launch/plan.py), which made
stage 2 1.14x DDP's step time on the 55M benchmark. When every buffer is in flight (or ``MAX_INFLIGHT + 1``
reduce-scatters of buckets below 1 MiB, which the pool neither keeps nor counts), finished reduce-scatters are
collected, and only if none has finished does the backward hook wait for the oldest. The reduce-scatter
runs in place (this rank's slice of the bucket receives the sum), and the slice is added, divided by N, to the
gradient slice the rank keeps across micro-steps (fp16 divides before the sum instead, for its range, as DDP).

Note [Collective order]: every rank must issue the same collectives in the same order. Buckets are launched in
a fixed order (by the registration index of their first parameter, descending: roughly the order backward
makes them ready); a bucket that is ready early waits for the buckets before it, and buckets whose
parameters got no gradient are launched at the end of backward with zeros. A parameter that gets no
gradient in a step thus gets a zero gradient, as in DeepSpeed and FSDP (DDP with ``find_unused_parameters``
instead leaves its ``.grad`` at ``None``, and a stateful optimizer skips it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn as nn

from zerorun.zero.comm import BufferPool, Comm
from zerorun.zero.flat import FlatBuffer, pack
from zerorun.zero.offload import CpuMasters, DiskMasters, Masters
from zerorun.zero.optimizers import NON_ELEMENTWISE_OPTIMIZERS, resolve_optimizer  # noqa: F401 (re-exported)
from zerorun.zero.user_model import UserModel
from zerorun.zero.precision import DTYPES, DynamicLossScaler, LossScaleConfig, cast_inputs, cast_model


@dataclass(frozen=True)
class ZeroConfig:
    """How the engine partitions and communicates.

    Attributes:
        stage: 0 (replicated, DDP-equivalent), 1 (optimizer states), 2 (+ gradients) partitioned.
        bucket_mb: size of one flat buffer (the unit of communication) in MiB (2**20 bytes).
        grad_accum_steps: micro-steps per optimizer step; ``backward`` scales the loss by ``1 / grad_accum_steps``.
        grad_clip: clip the global gradient L2 norm to this value; ``None`` or ``0`` for no clipping.
        units: stage 3: names of module classes gathered and freed as one unit (e.g. ``("Block",)``); empty
            to let zerorun pick units by parameter count.
        activation_checkpointing: stage 3: recompute each unit's forward in backward
            (``torch.utils.checkpoint``, non-reentrant) instead of keeping its activations.
        prefetch: stage 3: all-gather the next unit (in the order recorded in the first step) while the
            current one computes.
        persistence_threshold: stage 3: parameters of at most this many elements stay whole on every rank
            (Note [Persistent parameters] in ``stage3.py``); 0 for none.
        precision: ``"fp32"``, ``"bf16"`` or ``"fp16"``: dtype of parameters, gradients and collectives; fp32
            master slices and optimizer states either way (Note [Mixed precision] in ``precision.py``).
        reduce_dtype: ``None`` (reduce gradients in ``precision``) or ``"fp32"`` (reduce an fp32 copy).
        loss_scale: fp16 dynamic loss scaling (Note [Loss scaling]).
        offload_optimizer: ``"none"``, ``"cpu"`` or ``"disk"``: where master slices and optimizer states
            live and the step runs (``offload.py``).
        offload_path: ``disk``: folder for the swap files (created if missing).
        offload_buffer_mb: ``disk``: host buffer through which they are paged, in MiB.
    """

    stage: int = 0
    bucket_mb: float = 25.0
    grad_accum_steps: int = 1
    grad_clip: float | None = None
    units: tuple[str, ...] = ()
    activation_checkpointing: bool = False
    prefetch: bool = True
    persistence_threshold: int = 0
    precision: str = "fp32"
    reduce_dtype: str | None = None
    loss_scale: LossScaleConfig = LossScaleConfig()
    offload_optimizer: str = "none"
    offload_path: str | None = None
    offload_buffer_mb: float = 64.0

    def __post_init__(self) -> None:
        if self.stage not in (0, 1, 2, 3):
            raise ValueError(f"zero.stage must be 0, 1, 2 or 3, got {self.stage}")
        if self.precision not in DTYPES:
            raise ValueError(f"precision must be fp32, bf16 or fp16, got {self.precision!r}")
        if self.reduce_dtype not in (None, "fp32"):
            raise ValueError(f"zero.reduce_dtype must be fp32 or unset, got {self.reduce_dtype!r}")
        if self.offload_optimizer not in ("none", "cpu", "disk"):
            raise ValueError(f"zero.offload_optimizer must be none, cpu or disk, got {self.offload_optimizer!r}")
        if self.offload_optimizer == "disk" and not self.offload_path:
            raise ValueError("zero.offload_optimizer disk needs zero.offload_path (a folder for the swap files)")
        if self.offload_buffer_mb <= 0:
            raise ValueError(f"zero.offload_buffer_mb must be > 0, got {self.offload_buffer_mb}")
        if self.persistence_threshold < 0:
            raise ValueError(f"zero.persistence_threshold must be >= 0, got {self.persistence_threshold}")
        if self.bucket_mb <= 0:
            raise ValueError(f"zero.bucket_mb must be > 0, got {self.bucket_mb}")
        if self.grad_accum_steps < 1:
            raise ValueError(f"grad_accum_steps must be >= 1, got {self.grad_accum_steps}")


def default_param_groups(model: nn.Module, weight_decay: float, decay_1d: bool = False) -> list[dict[str, Any]]:
    """Two torch-style param groups over the trainable parameters of ``model``: tensors with 2 or more
    dimensions (matrices, embeddings) get ``weight_decay``; 1-D tensors (biases, norm weights) get 0 unless
    ``decay_1d`` (the GPT-2/nanoGPT convention). Empty groups are dropped."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 or decay_1d else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


class ZeroEngine(UserModel):
    """Wraps ``model`` for ZeRO data-parallel training on a process group. Build it with :func:`initialize`.

    Usage per optimizer step::

        for _ in range(grad_accum_steps):
            loss = engine(batch)["loss"]   # calls model.forward
            engine.backward(loss)
        grad_norm = engine.step()          # clip, optimizer step on this rank's slice, all-gather

    ``engine.optimizer`` is the user's ``torch.optim`` optimizer over this rank's flat slices; attach an LR
    scheduler to it as usual.
    """

    #: stages 2-3: MAX_INFLIGHT + 1 full bucket gradients at most, all of which may be in flight (Note [Gradient
    #: buffer pool]); stage 1 under zero.reduce_dtype: wide copies in flight.
    MAX_INFLIGHT = 2

    def __init__(self, model: nn.Module, *, optimizer: str | type, optimizer_kwargs: dict[str, Any],
                 param_groups: list[dict[str, Any]] | None, config: ZeroConfig,
                 process_group: dist.ProcessGroup | None, elementwise: bool = False) -> None:
        self.module = model
        self.config = config
        self.stage = config.stage
        self.comm = Comm(process_group)
        self.world_size = self.comm.world_size
        self.rank = self.comm.rank
        optimizer_cls = resolve_optimizer(optimizer, elementwise=elementwise)
        optimizer_kwargs = dict(optimizer_kwargs)
        if param_groups is None:
            param_groups = default_param_groups(model, optimizer_kwargs.pop("weight_decay", 0.0))
        # Note [Mixed precision]
        self.param_dtype = DTYPES[config.precision]
        self.reduce_dtype = torch.float32 if config.reduce_dtype == "fp32" else self.param_dtype
        self.scaler = DynamicLossScaler(config.loss_scale) if config.precision == "fp16" else None
        self.last_step_skipped = False
        self.skipped_steps = 0
        self._reduced: dict[FlatBuffer, torch.Tensor] = {}  # reduce_dtype wider than the gradients (stages 0-1)
        cast_model(model, self.param_dtype)
        self._frozen = [p for p in model.parameters() if not p.requires_grad]
        self._buffers = [b for b in model.buffers()]
        self._sync_initial_state()

        names = {}
        for i, (name, p) in enumerate(model.named_parameters()):
            names[p] = (i, name)
        seen: set[nn.Parameter] = set()
        self.buffers: list[FlatBuffer] = []
        bucket_bytes = int(config.bucket_mb * 2**20)
        group_options = []
        for g, group in enumerate(param_groups):
            params = list(group["params"])
            for p in params:
                if p not in names:
                    raise ValueError("param_groups holds a tensor that is not a parameter of the model")
                if not p.requires_grad:
                    raise ValueError(f"param_groups holds frozen parameter {names[p][1]!r}")
                if p in seen:
                    raise ValueError(f"parameter {names[p][1]!r} appears in more than one param group")
                seen.add(p)
            params.sort(key=lambda p: names[p][0])
            named = [(names[p][1], p) for p in params]
            for run in self._partition(named, bucket_bytes):
                self.buffers.append(FlatBuffer(run, g, self.world_size, self.rank, order=names[run[0][1]][0]))
            group_options.append({k: v for k, v in group.items() if k != "params"})
        missing = [names[p][1] for p in names if p.requires_grad and p not in seen]
        if missing:
            raise ValueError(f"trainable parameters missing from param_groups: {', '.join(missing[:5])}")
        self._slots = {p: buf.slots[p] for buf in self.buffers for p in buf.params}
        # Note [Collective order]
        self._launch_order = sorted(self.buffers, key=lambda b: b.order, reverse=True)

        self._materialize()

        # The optimizer sees one fp32 master per flat buffer: the whole buffer at stage 0, this rank's slice
        # above (offload.py; sub-groups of it with disk offload).
        self.masters = self._build_masters(optimizer_cls, optimizer_kwargs, group_options)
        self.optimizer = self.masters.optimizer
        self._opt_params = self.masters.params

        self._micro_step = 0
        self._sync = True
        self._ready: set[FlatBuffer] = set()
        self._ready_count: dict[FlatBuffer, int] = {b: 0 for b in self.buffers}
        self._next_launch = 0
        self._pending: list[tuple[FlatBuffer, Any, torch.Tensor | None]] = []
        self._written: dict[FlatBuffer, set[nn.Parameter]] = {}
        # Note [Gradient buffer pool]
        self._grad_pool = BufferPool(keep=self.MAX_INFLIGHT + 1)
        # Stages 2-3 divide the reduced slice by N (1/N of the work of dividing the bucket) except in fp16,
        # whose range needs the gradients divided before they are summed (as DDP always does).
        self._predivide = self.reduce_dtype == torch.float16
        self._hook_handles = [p.register_post_accumulate_grad_hook(self._on_grad_ready)
                              for buf in self.buffers for p in buf.params]
        # Note [The user's model stays the user's]: the parameter objects and their trainability are fixed here
        self._param_slots = [(mod, key, f"{mname}.{key}" if mname else key, p, p.requires_grad)
                             for mname, mod in model.named_modules() for key, p in mod._parameters.items()
                             if p is not None]

    # ------------------------------------------------------------------------------------- stage policy hooks
    def _sync_initial_state(self) -> None:
        """Make every rank start from rank 0's parameters and buffers, as DDP does."""
        self._broadcast_from_rank0([p.data for p in self.module.parameters()] + self._buffers)

    def _partition(self, named: list[tuple[str, nn.Parameter]], bucket_bytes: int):
        """Runs of consecutive parameters of one param group that form one flat buffer each."""
        return pack(named, bucket_bytes)

    def _materialize(self) -> None:
        """Lay parameters out in their flat buffers and allocate the gradients the stage keeps."""
        for buf in self.buffers:
            buf.flatten_params()
            if self.stage in (0, 1):
                buf.grad = torch.zeros_like(buf.data)
                for p in buf.params:
                    p.grad = buf.view_of(buf.grad, p)
            else:
                buf.shard_grad = torch.zeros(buf.shard_numel, dtype=self.reduce_dtype, device=buf.device)

    def _param_slice(self, buf: FlatBuffer) -> torch.Tensor:
        """The part of ``buf``'s parameters this rank's optimizer updates: all of it at stage 0, else the slice."""
        return buf.data if self.stage == 0 else buf.shard(buf.data)

    def _grad_slice(self, buf: FlatBuffer) -> torch.Tensor:
        """This rank's reduced gradient for :meth:`_param_slice` (same shape; dtype ``reduce_dtype``)."""
        if buf in self._reduced:
            return self._reduced[buf]
        return {0: buf.grad, 1: buf.shard(buf.grad) if buf.grad is not None else None, 2: buf.shard_grad}[self.stage]

    def _build_masters(self, optimizer_cls: type, optimizer_kwargs: dict, group_options: list[dict]) -> Masters:
        c = self.config
        args = ([self._param_slice(b) for b in self.buffers], [b.group_index for b in self.buffers], group_options,
                optimizer_cls, optimizer_kwargs)
        if c.offload_optimizer == "cpu":
            return CpuMasters(*args)
        if c.offload_optimizer == "disk":
            return DiskMasters(*args, folder=c.offload_path, buffer_bytes=int(c.offload_buffer_mb * 2**20),
                               rank=dist.get_rank())
        fp32 = self.param_dtype == torch.float32 and self.reduce_dtype == torch.float32
        return Masters(*args, alias_grads=[self._grad_slice(b) for b in self.buffers] if fp32 else None)

    def master_slices(self) -> list[torch.Tensor]:
        """This rank's fp32 master values: one 1-D fp32 tensor per flat buffer of :attr:`buffers`, in that
        order, of ``shard_numel`` elements (stage 0: ``numel``), padding included. fp32 without offload: views
        of the parameters; ``cpu``: the host masters; ``disk``: read from the swap file. Do not modify."""
        return self.masters.master_slices()

    def close(self) -> None:
        """Release the offload swap file and its reader thread (also done at process exit)."""
        self.masters.close()

    @property
    def loss_scale(self) -> float | None:
        """fp16: the loss scale the next backward uses (Note [Loss scaling]); ``None`` otherwise."""
        return self.scaler.scale if self.scaler is not None else None

    def _after_step(self) -> None:
        """Stages 1-2: all-gather the updated slices into the full parameters."""
        if self.stage > 0:
            self.comm.wait([self.comm.all_gather(buf.data, buf.shard(buf.data)) for buf in self.buffers])

    # ----------------------------------------------------------------------------------------------- forward
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run ``model(*args, **kwargs)``. In training mode with grad enabled, module buffers (e.g. BatchNorm
        running stats) are first broadcast from rank 0, as DDP does (``broadcast_buffers=True``)."""
        self.check_parameters()
        if self._buffers and self.module.training and torch.is_grad_enabled():
            self._broadcast_from_rank0(self._buffers)
        if self.param_dtype != torch.float32:  # Note [Mixed precision]: no autocast, inputs in the params' dtype
            args, kwargs = cast_inputs((args, kwargs), self.param_dtype)
        return self.module(*args, **kwargs)

    def _broadcast_from_rank0(self, tensors: Iterable[torch.Tensor]) -> None:
        self.comm.wait([self.comm.broadcast(t, 0) for t in tensors])

    # ---------------------------------------------------------------------------------------------- backward
    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate ``loss / grad_accum_steps`` (scalar) and reduce gradients as the stage prescribes.

        Raises:
            RuntimeError: ``loss`` is not a scalar tensor, or more micro-steps than ``grad_accum_steps`` were
                run without :meth:`step`.
        """
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise RuntimeError(f"backward needs a scalar loss tensor, got {type(loss).__name__}")
        if self._micro_step >= self.config.grad_accum_steps:
            raise RuntimeError(f"{self._micro_step + 1} backward calls without step(); "
                               f"grad_accum_steps is {self.config.grad_accum_steps}")
        self.check_parameters()
        last = self._micro_step + 1 == self.config.grad_accum_steps
        self._sync = last or self.stage >= 2
        if self.scaler is not None:  # Note [Loss scaling]
            loss = loss.float() * self.scaler.scale
        (loss / self.config.grad_accum_steps).backward()
        self._finish_backward()
        self._micro_step += 1

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        buf = self._slots[p].buffer
        if self.stage in (0, 1):
            view = buf.view_of(buf.grad, p)
            if p.grad.data_ptr() != view.data_ptr():  # grads were reset to None by someone: keep our layout
                view.add_(p.grad)
                p.grad = view
            if not self._sync:
                return
        else:
            if buf in self._ready:
                raise RuntimeError(f"parameter {buf.names[buf.params.index(p)]!r} received a second gradient in "
                                   "one backward after its bucket was reduced (reentrant activation checkpointing? "
                                   "use torch.utils.checkpoint with use_reentrant=False)")
            if buf.grad is None:  # filled by copies; what no gradient reaches is zeroed at launch
                buf.grad = self._take_grad_buffer(buf)
                self._written[buf] = set()
            buf.view_of(buf.grad, p).copy_(p.grad)
            self._written[buf].add(p)
            p.grad = None
        self._ready_count[buf] += 1
        if self._ready_count[buf] == len(buf.params):
            self._ready.add(buf)
            self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next_launch < len(self._launch_order) and self._launch_order[self._next_launch] in self._ready:
            self._launch(self._launch_order[self._next_launch])
            self._next_launch += 1

    def _take_grad_buffer(self, buf: FlatBuffer) -> torch.Tensor:
        """Stages 2-3: a full gradient buffer for ``buf`` (1-D, ``buf.numel`` elements of ``reduce_dtype``,
        uninitialized) from the pool (Note [Gradient buffer pool])."""
        pool, args, cap = self._grad_pool, (buf.numel, self.reduce_dtype, buf.device), self.MAX_INFLIGHT + 1

        def full() -> bool:  # no buffer without allocating past the cap, or as many in flight as the cap
            return (not pool.fits(*args) and pool.taken >= cap) or len(self._pending) >= cap

        if full():
            while self._pending and self._pending[0][1].is_completed():  # finished: no wait
                self._complete(*self._pending.pop(0))
            while full() and self._pending:
                self._complete(*self._pending.pop(0))  # wait for the oldest
        return pool.take(*args)

    def _launch(self, buf: FlatBuffer) -> None:
        if buf.grad is None:  # stage 2, no parameter of the bucket got a gradient this micro-step
            buf.grad = self._take_grad_buffer(buf)
            buf.grad.zero_()
        elif self.stage >= 2:  # zero the padding and the parameters that got no gradient
            written = self._written.pop(buf, set())
            buf.grad[buf.unpadded_numel:].zero_()
            for p in buf.params:
                if p not in written:
                    buf.view_of(buf.grad, p).zero_()
        grad = buf.grad
        if grad.dtype != self.reduce_dtype:  # stages 0-1 under zero.reduce_dtype: reduce a wider copy
            grad = grad.to(self.reduce_dtype)
        if self.stage >= 2:  # in place: this rank's slice of the bucket receives the sum, added to the kept slice
            if self._predivide:
                grad.div_(self.world_size)
            self._pending.append((buf, self.comm.reduce_scatter(buf.shard(grad), grad), None))
            return
        grad.div_(self.world_size)
        if self.stage == 0:
            self._pending.append((buf, self.comm.all_reduce(grad), None if grad is buf.grad else grad))
        elif grad is buf.grad:
            self._pending.append((buf, self.comm.reduce_scatter(buf.shard(buf.grad), buf.grad), None))
        else:
            out = torch.empty(buf.shard_numel, dtype=self.reduce_dtype, device=buf.device)
            self._pending.append((buf, self.comm.reduce_scatter(out, grad), out))
            # stage 1 under zero.reduce_dtype holds at most MAX_INFLIGHT wide copies of its buckets at once
            while len(self._pending) > self.MAX_INFLIGHT:
                self._complete(*self._pending.pop(0))

    def _complete(self, buf: FlatBuffer, work: Any, out: torch.Tensor | None) -> None:
        self.comm.wait([work])
        if self.stage >= 2:
            shard = buf.shard(buf.grad)
            buf.shard_grad.add_(shard, alpha=1.0 if self._predivide else 1.0 / self.world_size)
            self._grad_pool.give_back(buf.grad)
            buf.grad = None
        elif out is not None:  # zero.reduce_dtype at stages 0-1: the reduced wider copy
            self._reduced[buf] = out

    def _finish_backward(self) -> None:
        if not self._sync:
            return
        self._ready.update(self.buffers)  # buckets with unused parameters go now, with zeros (Note [Collective order])
        self._launch_ready()
        while self._pending:
            self._complete(*self._pending.pop(0))
        self._ready.clear()
        self._ready_count = dict.fromkeys(self.buffers, 0)
        self._next_launch = 0

    # -------------------------------------------------------------------------------------------------- step
    def step(self) -> float:
        """Finish the optimizer step after ``grad_accum_steps`` calls of :meth:`backward`: compute the global
        gradient L2 norm over all ranks' slices, clip to ``grad_clip`` (as ``torch.nn.utils.clip_grad_norm_``),
        step the optimizer on this rank's fp32 master slices, write them into the parameters (cast to
        ``precision``) and all-gather them, zero the gradients. fp16: the norm is of the unscaled gradients;
        if it is not finite the step is skipped on every rank (:attr:`last_step_skipped`,
        :attr:`skipped_steps`) and the loss scale lowered (Note [Loss scaling]).

        Returns:
            The global gradient L2 norm before clipping (float), equal on every rank (inf or nan on a
            skipped step).

        Raises:
            RuntimeError: fewer than ``grad_accum_steps`` backward calls since the last step.
        """
        if self._micro_step != self.config.grad_accum_steps:
            raise RuntimeError(f"step() after {self._micro_step} backward calls; grad_accum_steps is "
                               f"{self.config.grad_accum_steps}")
        self._grad_pool.clear()  # Note [Gradient buffer pool]: not held through the optimizer step
        self.comm.release_buffers()
        grads = [self._grad_slice(buf) for buf in self.buffers]
        sq = torch.zeros((), dtype=torch.float32, device=grads[0].device)
        for g in grads:
            sq += torch.linalg.vector_norm(g, dtype=torch.float32) ** 2
        if self.stage > 0:
            sq = self._all_reduce_norm(sq)
        norm = sq.sqrt()
        coef = None
        self.last_step_skipped = False
        if self.scaler is not None:  # Note [Loss scaling]: the same verdict on every rank (sq is all-reduced)
            scale = self.scaler.scale
            norm = norm / scale
            overflow = not bool(torch.isfinite(norm))
            self.scaler.update(overflow)
            if overflow:
                self.last_step_skipped = True
                self.skipped_steps += 1
                self._zero_grads()
                return float(norm)
            coef = torch.full((), 1.0 / scale, dtype=torch.float32, device=norm.device)
        if self.config.grad_clip:
            clip = torch.clamp(self.config.grad_clip / (norm + 1e-6), max=1.0)
            coef = clip if coef is None else coef * clip
        self.masters.step(grads, coef)
        self._after_step()
        self._zero_grads()
        return float(norm)

    def _all_reduce_norm(self, sq: torch.Tensor) -> torch.Tensor:
        """The squared gradient norm ``sq`` (0-d fp32) summed over the ranks."""
        self.comm.wait([self.comm.all_reduce(sq)])
        return sq

    def _zero_grads(self) -> None:
        for buf in self.buffers:
            (buf.shard_grad if self.stage >= 2 else buf.grad).zero_()
        self._reduced.clear()
        self._micro_step = 0

    # ------------------------------------------------------------------------------------------------ report
    @property
    def num_params(self) -> int:
        """Trainable parameters Ψ managed by the engine (elements, shared parameters counted once)."""
        return sum(buf.unpadded_numel for buf in self.buffers)

    def memory_bytes(self) -> dict[str, int]:
        """Model-state bytes this rank holds, counted from the tensors it owns.

        Returns:
            ``{"params": ..., "grads": ..., "optimizer": ...}`` in bytes. ``params`` includes frozen
            parameters, flat padding included everywhere; ``optimizer`` is the optimizer states plus the fp32
            master slices where they are separate from the parameters (mixed precision), in device memory
            (offloaded bytes: :meth:`offload_bytes`). Theory for fp32 Adam (ZeRO §5; Ψ params, N ranks):
            stage 0 4Ψ + 4Ψ + 8Ψ; stage 1 4Ψ + 4Ψ + 8Ψ/N; stage 2 4Ψ + 4Ψ/N + 8Ψ/N; mixed precision
            (ZeRO §3.1, K = 12): stage 0 2Ψ + 2Ψ + 12Ψ; stage 1 2Ψ + 2Ψ + 12Ψ/N; stage 2 2Ψ + 2Ψ/N + 12Ψ/N.
        """
        params = sum(buf.data.nbytes for buf in self.buffers if buf.data is not None)
        params += sum(p.nbytes for p in self._frozen)
        if self.stage in (0, 1):
            grads = sum(buf.grad.nbytes for buf in self.buffers)
        else:  # stages 2-3: the gradient slices (full bucket gradients are transient)
            grads = sum(buf.shard_grad.nbytes for buf in self.buffers)
        return {"params": params, "grads": grads, "optimizer": self.masters.memory_bytes()["optimizer"]}

    def offload_bytes(self) -> dict[str, int]:
        """Optimizer bytes held off the device: ``{"host": ..., "disk": ...}`` (``cpu`` offload on CUDA: the
        pinned masters and states; ``disk``: the paging buffer and the swap file's size)."""
        held = self.masters.memory_bytes()
        return {"host": held["host"], "disk": held["disk"]}

    def comm_stats(self) -> dict[str, float]:
        """Cumulative ``bytes_sent`` (bytes) and ``wait_s`` (seconds) of this rank's collectives."""
        return {"bytes_sent": self.comm.bytes_sent, "wait_s": self.comm.wait_s}

    def optimizer_states(self) -> list[dict[str, torch.Tensor]]:
        """This rank's optimizer state per flat buffer of :attr:`buffers` (``{name: tensor}``; states with one
        element per master element are 1-D of the master's shape, scalars such as Adam's ``step`` as they
        are; empty before the first step). ``disk`` offload: read from the swap file (new CPU tensors)."""
        return self.masters.buffer_states()

    def load_master_slices(self, values: list[torch.Tensor],
                           states: list[dict[str, torch.Tensor]] | None = None) -> None:
        """Overwrite this rank's fp32 master slices with ``values`` (one 1-D fp32 tensor per flat buffer, shaped
        as :meth:`master_slices`) and the optimizer state with ``states`` (as :meth:`optimizer_states`;
        ``None``: none), wherever they live (device, host, swap file), then :meth:`refresh_params`. Used to
        resume a checkpoint (Note [Checkpoint layout] in ``state.py``). Collective at stages 1-2."""
        self.masters.load(values, states)
        self._after_step()

    def refresh_params(self) -> None:
        """Make the model's parameters equal the master slices again (cast to ``precision``): stages 1-2 then
        all-gather the slices; stage 3 keeps only the slice. Collective at stages 1-2."""
        self.masters.write_params()
        self._after_step()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The model's full (unsharded) state dict; parameters are whole on every rank at stages 0-2."""
        return self.module.state_dict()


def initialize(model: nn.Module, *, optimizer: str | type = "AdamW", optimizer_kwargs: dict[str, Any] | None = None,
               param_groups: list[dict[str, Any]] | None = None, config: ZeroConfig | None = None,
               process_group: dist.ProcessGroup | None = None, elementwise: bool = False) -> ZeroEngine:
    """Wrap ``model`` in a :class:`ZeroEngine` on ``process_group`` (default: the world).

    Args:
        model: the model, built identically on every rank (rank 0's values are broadcast), or built by
            :func:`~zerorun.zero.deferred.deferred_init` on the meta device: stage 3 then materializes only
            this rank's slices, with the values normal construction would give.
        optimizer: a ``torch.optim`` class or its name; it must be elementwise (Note [Elementwise optimizers]
            in ``optimizers.py``).
        optimizer_kwargs: keyword arguments for the optimizer (``lr``, ``betas``, ``weight_decay``, ...).
        param_groups: torch-style groups (dicts with ``params`` and per-group options); by default
            :func:`default_param_groups` with ``optimizer_kwargs["weight_decay"]``.
        config: :class:`ZeroConfig` (stage, bucket size, accumulation, clipping).
        elementwise: declare an optimizer class outside ``optimizers.ELEMENTWISE_OPTIMIZERS`` elementwise.

    Raises:
        ValueError: unsupported stage, unknown or non-elementwise optimizer, malformed ``param_groups``.
        RuntimeError: ``torch.distributed`` is not initialized.
    """
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: call dist.init_process_group first")
    from zerorun.zero.deferred import is_deferred, materialize

    config = config or ZeroConfig()
    kwargs = dict(optimizer=optimizer, optimizer_kwargs=optimizer_kwargs or {}, param_groups=param_groups,
                  config=config, process_group=process_group, elementwise=elementwise)
    if config.stage == 3:
        from zerorun.zero.stage3 import Stage3Engine

        return Stage3Engine(model, **kwargs)
    if is_deferred(model):
        if param_groups is not None:
            raise ValueError("param_groups of a deferred model must be given at stage 3 only; at stages 0-2 "
                             "materialize it first (zerorun.zero.materialize)")
        metas = dict(model.named_parameters())
        materialize(model)
        from zerorun.zero.stage3_checks import carry_hooks

        for name, p in model.named_parameters():  # hooks the constructor registered move to the real parameters
            if name in metas and metas[name] is not p:
                carry_hooks(metas[name], p, name)
    return ZeroEngine(model, **kwargs)
