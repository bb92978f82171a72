"""The ZeRO engine for stages 0, 1 and 2 (Rajbhandari et al., arXiv:1910.02054, §5).

One mechanism, the stage as policy: what each stage does is one row of ``policy.py`` (Note [Stage policies]);
flat buffers: Note [Flat buffer layout] in ``flat.py``; the gradients' path (readiness, launch order,
in-flight bound): ``reducer.py``; fp32 master slices and optimizer states: ``offload.py``; stage 3's
sharded parameters: ``stage3.py``.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from zerorun.zero import allocator
from zerorun.zero.broadcast import broadcast_coalesced
from zerorun.zero.comm import Comm
from zerorun.zero.config import ZeroConfig
from zerorun.zero.flat import FlatBuffer, pack
from zerorun.zero.gloo_reduce_scatter import JOIN_BYTES
from zerorun.zero.hierarchy import gradient_path
from zerorun.zero.gradnorm import NORM_ROW, global_sum_of_squares, sum_of_squares  # noqa: F401 (re-exported)
from zerorun.zero.offload import CpuMasters, DiskMasters, Masters
from zerorun.zero.optimizer_guard import guard
from zerorun.zero.optimizers import (NON_ELEMENTWISE_OPTIMIZERS, default_param_groups,  # noqa: F401 (re-exported)
                                     resolve_optimizer)
from zerorun.zero.param_writes import DifferingWrites, ParamWrites
from zerorun.zero.policy import POLICIES
from zerorun.zero.precision import DTYPES, DynamicLossScaler, cast_and_report, cast_inputs, is_wide
from zerorun.zero.reducer import GradReducer
from zerorun.zero.user_model import UserModel, parameter_slots, spoiled_by

__all__ = ["ZeroConfig", "ZeroEngine", "default_param_groups", "resolve_optimizer"]


class ZeroEngine(UserModel):
    """Wraps ``model`` for ZeRO data-parallel training on a process group. Build it with :func:`~zerorun.zero.build.initialize`.

    Usage per optimizer step::

        for _ in range(grad_accum_steps):
            loss = engine(batch)["loss"]   # calls model.forward
            engine.backward(loss)
        grad_norm = engine.step()          # clip, optimizer step on this rank's slice, all-gather

    ``engine.optimizer`` is the user's ``torch.optim`` optimizer over this rank's flat slices; attach an LR
    scheduler to it as usual. ``engine.kept_dtypes``: ``{name: dtype name}`` of the floating parameters kept
    in a dtype other than ``precision``'s (float64: Note [Wide parameters] in ``precision.py``).
    """

    #: stages 1-3: reductions in flight, each holding a bucket-sized buffer (Note [Waiting in hooks] in reducer.py)
    MAX_INFLIGHT = 2

    def __init__(self, model: nn.Module, *, optimizer: str | type, optimizer_kwargs: dict[str, Any],
                 param_groups: list[dict[str, Any]] | None, config: ZeroConfig,
                 process_group: dist.ProcessGroup | None, elementwise: bool = False) -> None:
        self.module, self.config, self.stage = model, config, config.stage
        self.policy = POLICIES[config.stage]  # Note [Stage policies]
        self.comm = Comm(process_group)
        # Notes [Two-level reduce-scatter] in hierarchy.py, [Quantized gradients] in quantized_grads.py
        self.comm.grad_path = gradient_path(self.comm, config.hierarchy, config.quantize_grads, config.quantize_block)
        self.world_size, self.rank = self.comm.world_size, self.comm.rank
        optimizer_cls = resolve_optimizer(optimizer, elementwise=elementwise)
        optimizer_kwargs = dict(optimizer_kwargs)
        if param_groups is None:
            param_groups = default_param_groups(model, optimizer_kwargs.pop("weight_decay", 0.0))
        # Note [Mixed precision]
        self.param_dtype = DTYPES[config.precision]
        self.reduce_dtype = torch.float32 if config.reduce_dtype == "fp32" else self.param_dtype
        self.scaler = DynamicLossScaler(config.loss_scale) if config.precision == "fp16" else None
        self.last_step_skipped, self.skipped_steps = False, 0
        self._cast(model)
        self._frozen = [p for p in model.parameters() if not p.requires_grad]
        self._sync_initial_state()

        names = {p: (i, name) for i, (name, p) in enumerate(model.named_parameters())}
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
        # Note [Wide parameters] in precision.py: the gradient norm and clip factor in float64 over float64 ones
        self._norm_dtype = torch.float64 if any(is_wide(b.dtype) for b in self.buffers) else torch.float32

        self._materialize()
        self.reducer = GradReducer(self.buffers, self.comm, self.policy, reduce_dtype=self.reduce_dtype,
                                   accum_dtype=config.accum_dtype, max_inflight=self.MAX_INFLIGHT,
                                   coalesce_bytes=min(bucket_bytes, JOIN_BYTES))
        self.reducer.allocate()

        # The optimizer sees one fp32 master per flat buffer: the whole buffer at stage 0, this rank's slice
        # above (offload.py; sub-groups of it with disk offload).
        self.masters = self._build_masters(optimizer_cls, optimizer_kwargs, group_options)
        self.optimizer = self.masters.optimizer
        guard(self.optimizer, self.comm, self.stage)  # Note [The engine's optimizer] in optimizer_guard.py
        # Notes [Writes between steps] and [Writes that differ by rank] (stages 1-2) in param_writes.py
        self.writes = ParamWrites(self.buffers) if self.stage < 3 else None
        self.reducer.rider = DifferingWrites(self) if self.policy.gather_after_step else None
        self._micro_step = 0
        # Note [The user's model stays the user's]: the parameter objects, trainability and dtypes are fixed here
        self._param_slots = parameter_slots(model, pointers=self.stage < 3)

    def _cast(self, model: nn.Module) -> None:
        """Cast ``model`` to the precision (Note [Mixed precision]); rank 0 warns once naming the parameters left in
        their own dtype under bf16/fp16 (Note [Wide parameters] in ``precision.py``) and those cast from another
        dtype below fp32."""
        kept, warning = cast_and_report(model, self.param_dtype, self.config.precision)
        self.kept_dtypes = {n: str(d).removeprefix("torch.") for n, d in kept.items()}
        if warning and self.rank == 0:
            warnings.warn(warning, stacklevel=4)

    # ------------------------------------------------------------------------------------- stage policy hooks
    def _sync_initial_state(self) -> None:
        """Make every rank start from rank 0's parameters and buffers, as DDP does (Note [Coalesced
        broadcasts] in broadcast.py; buffers whatever ``broadcast_buffers`` says, as torch's newer
        ``forward_sync_buffers``)."""
        broadcast_coalesced(self.comm, [p.detach() for p in self.module.parameters()]
                            + [b.detach() for b in self.module.buffers()])

    def _partition(self, named: list[tuple[str, nn.Parameter]], bucket_bytes: int):
        """Runs of consecutive parameters of one param group that form one flat buffer each."""
        return pack(named, bucket_bytes)

    def _materialize(self) -> None:
        """Lay parameters out in their flat buffers (the reducer allocates gradients)."""
        for buf in self.buffers:
            buf.flatten_params()

    def _param_slice(self, buf: FlatBuffer) -> torch.Tensor:
        """The part of ``buf``'s parameters this rank's optimizer updates: all of it at stage 0, else the slice."""
        return buf.shard(buf.data) if self.policy.partition_optimizer else buf.data

    def _grad_slice(self, buf: FlatBuffer) -> torch.Tensor:
        """This rank's reduced gradient for :meth:`_param_slice` (same shape; dtype ``reduce_dtype``)."""
        return self.reducer.grad_slice(buf)

    def _build_masters(self, optimizer_cls: type, optimizer_kwargs: dict, group_options: list[dict]) -> Masters:
        c = self.config
        args = ([self._param_slice(b) for b in self.buffers], [b.group_index for b in self.buffers], group_options,
                optimizer_cls, optimizer_kwargs)
        part = self.policy.partition_optimizer  # Note [Unused parameters] in masters.py: per-parameter segments
        segments = [b.segments(b.lo, b.shard_numel) if part else b.segments(0, b.numel) for b in self.buffers]
        if c.offload_optimizer == "cpu":
            return CpuMasters(*args, segments=segments)
        if c.offload_optimizer == "disk":
            return DiskMasters(*args, folder=c.offload_path, buffer_bytes=int(c.offload_buffer_mb * 2**20),
                               rank=dist.get_rank(), segments=segments)
        fp32 = self.param_dtype == torch.float32 and self.reduce_dtype == torch.float32
        return Masters(*args, alias_grads=[self._grad_slice(b) for b in self.buffers] if fp32 else None,
                       segments=segments)

    def _used(self) -> list[list[bool]] | None:
        """Per flat buffer, per parameter: whether it got a gradient on some rank in this step (Note [Unused
        parameters] in ``masters.py``); ``None`` when the reducer has not learnt it (all count as used)."""
        used = self.reducer.used
        if used is None:
            return None
        return [[p in used for p in buf.params] for buf in self.buffers]

    def master_slices(self) -> list[torch.Tensor]:
        """This rank's fp32 master values: one 1-D fp32 tensor (float64 for a float64 buffer: Note [Wide
        parameters] in ``precision.py``) per flat buffer of :attr:`buffers`, in that order, of ``shard_numel``
        elements (stage 0: ``numel``), padding included. fp32 without offload: views of the parameters; ``cpu``: the
        host masters; ``disk``: read from the swap file. Do not modify. Writes since the step are taken first (Note
        [Writes between steps] in param_writes.py: a checkpoint saves them)."""
        self.take_writes()
        return self.masters.master_slices()

    def close(self) -> None:
        """Release the offload swap file and its reader thread (also done at process exit); forward, backward and
        step raise from then on."""
        self.closed = True
        self.masters.close()

    @property
    def loss_scale(self) -> float | None:
        """fp16: the loss scale the next backward uses (Note [Loss scaling]); ``None`` otherwise."""
        return self.scaler.scale if self.scaler is not None else None

    def _after_step(self) -> None:
        """Stages 1-2: all-gather the updated slices into the full parameters."""
        if self.policy.gather_after_step:
            self.comm.wait([self.comm.all_gather(buf.data, buf.shard(buf.data)) for buf in self.buffers])
        if self.writes is not None:  # Note [Writes between steps] in param_writes.py: the engine wrote them
            self.writes.mark()

    # ----------------------------------------------------------------------------------------------- forward
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run ``model(*args, **kwargs)``. In training mode with grad enabled and ``broadcast_buffers`` (the
        default), module buffers (e.g. BatchNorm running stats) are first broadcast from rank 0 as DDP does:
        one broadcast per dtype (Note [Coalesced broadcasts] in broadcast.py)."""
        self.check_parameters()
        if self.config.broadcast_buffers and self.module.training and torch.is_grad_enabled():
            broadcast_coalesced(self.comm, [b.detach() for b in self.module.buffers()])  # reassigned ones too
        if self.param_dtype != torch.float32:  # Note [Mixed precision]: no autocast, inputs in the params' dtype
            args, kwargs = cast_inputs((args, kwargs), self.param_dtype)
        return self.module(*args, **kwargs)

    # ---------------------------------------------------------------------------------------------- backward
    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate ``loss / grad_accum_steps`` (scalar) and reduce gradients as the stage prescribes. After
        the last micro-step ``p.grad`` is the reduced gradient at stage 0 and ``None`` above (Note [Stage policies]).

        Raises:
            RuntimeError: ``loss`` is not a scalar tensor, more micro-steps than ``grad_accum_steps`` were run
                without :meth:`step`, or a backward raised since (Note [A backward that raised] in user_model.py).
        """
        self._check_backward(loss)
        self.check_parameters()
        self.reducer.begin(last_micro_step=self._micro_step + 1 == self.config.grad_accum_steps)
        if self.scaler is not None:  # Note [Loss scaling]
            loss = loss.float() * self.scaler.scale
        try:
            (loss / self.config.grad_accum_steps).backward()
            self.reducer.running = False  # Note [One backward per micro-step] in user_model.py: over
            self._finish_backward()
        except BaseException as e:  # Note [A backward that raised] in user_model.py: this step's gradients partial
            self.reducer.running = False
            self.reducer.spoiled = self.reducer.spoiled or spoiled_by(e)
            raise
        self._micro_step += 1

    def _check_backward(self, loss: Any) -> None:
        """What :meth:`backward` refuses, checked before any collective (stage 3's gathers and checks too): the
        engine is unchanged and the same processes go on with a correct call. Raises RuntimeError."""
        self.check_open()
        self.check_grads()
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            shape = f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else ""
            raise RuntimeError(f"backward needs a scalar loss tensor, got {type(loss).__name__}{shape} (reduce it: "
                               "loss.mean() or loss.sum())")
        if self._micro_step >= self.config.grad_accum_steps:
            raise RuntimeError(f"{self._micro_step + 1} backward calls without engine.step(); grad_accum_steps is "
                               f"{self.config.grad_accum_steps}: call engine.step() first (the engine is unchanged; "
                               "engine.optimizer.step() does not step it)")

    def _finish_backward(self) -> None:
        self.reducer.finish()

    # -------------------------------------------------------------------------------------------------- step
    def step(self) -> torch.Tensor:
        """Finish the optimizer step after ``grad_accum_steps`` calls of :meth:`backward`: compute the global
        gradient L2 norm over all ranks' slices, clip to ``grad_clip`` (as ``torch.nn.utils.clip_grad_norm_``:
        on the device, no host read), step the optimizer once on this rank's fp32 master slices (Note [One
        optimizer step] in ``masters.py``), write them into the parameters (cast to ``precision``) and
        all-gather them, zero the gradients. fp16: the norm is of the unscaled gradients; if it is not finite
        the step is skipped on every rank (:attr:`last_step_skipped`, :attr:`skipped_steps`) and the loss scale
        lowered (Note [Loss scaling]): the step's one host read. Under mimalloc, its free memory then goes back to
        the kernel (``zero.allocator.collect``, Note [Rank allocator]; optimizer offloaded to disk included).

        Returns:
            The global gradient L2 norm before clipping: a 0-d fp32 tensor (fp64 when a parameter is float64:
            Note [Wide parameters] in ``precision.py``) on the gradients' device, equal on every rank (inf or
            nan on a skipped step). Read it (``float()``) only when it is needed: on a GPU
            the read waits for the step.

        Raises:
            RuntimeError: fewer than ``grad_accum_steps`` backward calls since the last step, or a backward raised
                since (Note [A backward that raised] in user_model.py).
        """
        self.check_open()
        self.check_grads()
        if self._micro_step != self.config.grad_accum_steps:  # before any collective
            raise RuntimeError(f"step() after {self._micro_step} backward calls; grad_accum_steps is "
                               f"{self.config.grad_accum_steps}: run the remaining micro-steps first (the "
                               "engine is unchanged)")
        self.take_writes()  # Note [Writes between steps] in param_writes.py
        self.reducer.pool.clear()  # Note [Gradient buffer pool]: not held through the optimizer step
        self.comm.release_buffers()
        grads = [self._grad_slice(buf) for buf in self.buffers]
        sq = global_sum_of_squares(grads)
        if self.policy.partition_optimizer:  # summed over the ranks
            self.comm.wait([self.comm.all_reduce(sq)])
        norm = sq.sqrt().to(self._norm_dtype)
        coef = None
        self.last_step_skipped = False
        if self.scaler is not None:  # Note [Loss scaling]: the same verdict on every rank (sq is all-reduced)
            scale = self.scaler.scale
            norm = norm / scale
            overflow = not bool(torch.isfinite(norm))  # fp16's one host read per step
            self.scaler.update(overflow)
            if overflow:
                self.last_step_skipped = True
                self.skipped_steps += 1
                self._zero_grads()
                allocator.collect()
                return norm
            coef = torch.full((), 1.0 / scale, dtype=norm.dtype, device=norm.device)
        if self.config.grad_clip:
            clip = torch.clamp(self.config.grad_clip / (norm + 1e-6), max=1.0)
            coef = clip if coef is None else coef * clip
        self.masters.step(grads, coef, self._used())
        self._after_step()
        self._zero_grads()
        allocator.collect()  # Note [Rank allocator]: under mimalloc what the step freed goes back (host only)
        return norm

    def _zero_grads(self, discard: bool = False) -> None:
        """After the step: zero the gradients; with ``discard``, drop a step's (Note [A backward that raised])."""
        if discard:
            self.reducer.discard()
        else:
            self.reducer.zero_grads()
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
        grads = self.reducer.grad_bytes()  # stages 2-3: the slices (full bucket gradients are transient)
        return {"params": params, "grads": grads, "optimizer": self.masters.memory_bytes()["optimizer"]}

    def offload_bytes(self) -> dict[str, int]:
        """Optimizer bytes held off the device: ``{"host": ..., "disk": ...}`` (``cpu`` offload on CUDA: the
        pinned masters and states; ``disk``: the paging buffer and the swap file's size)."""
        held = self.masters.memory_bytes()
        return {"host": held["host"], "disk": held["disk"]}

    def comm_stats(self) -> dict[str, float]:
        """Cumulative ``bytes_sent`` (bytes), ``bytes_inter_node`` (of them, to ranks on other nodes: Note
        [Nodes of a group] in topology.py) and ``wait_s`` (seconds) of this rank's collectives: the engine's Comm and
        its gradients' levels' (zero.hierarchy or quantized gradients on several nodes: Note [Two-level
        reduce-scatter] in hierarchy.py)."""
        comms = [self.comm] + (self.comm.grad_path.comms if self.comm.grad_path is not None else [])
        return {"bytes_sent": sum(c.bytes_sent for c in comms),
                "bytes_inter_node": sum(c.bytes_sent_inter_node for c in comms), "wait_s": self.comm.wait_s}

    def optimizer_states(self) -> list[dict[str, torch.Tensor]]:
        """This rank's optimizer state per flat buffer of :attr:`buffers` (``{name: tensor}``; states with one
        element per master element are 1-D of the master's shape, scalars such as Adam's ``step`` as they
        are; empty before the first step). ``disk`` offload: read from the swap file (new CPU tensors)."""
        return self.masters.buffer_states()

    def load_master_slices(self, values: list[torch.Tensor] | None,
                           states: list[dict[str, torch.Tensor]] | None = None,
                           param_scalars: list[list[dict[str, torch.Tensor] | None]] | None = None) -> None:
        """Overwrite this rank's fp32 master slices with ``values`` (one 1-D tensor per flat buffer, shaped and
        typed as :meth:`master_slices`) and the optimizer state with ``states`` (as :meth:`optimizer_states`;
        ``None``: none) and ``param_scalars`` (per buffer, per parameter: its scalar states, ``None`` for no
        state; ``None``: each buffer's scalars stand for all its parameters), wherever they live (device, host,
        swap file), then :meth:`refresh_params`. Used to resume a checkpoint (Note [Checkpoint layout] in
        ``state.py``). Collective at stages 1-2."""
        self.masters.load(values, states, param_scalars)
        self._after_step()

    def refresh_params(self) -> None:
        """Make the model's parameters equal the master slices again (cast to ``precision``): stages 1-2 then
        all-gather the slices; stage 3 keeps only the slice. Collective at stages 1-2."""
        self.masters.write_params()
        self._after_step()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The model's full (unsharded) state dict; parameters are whole on every rank at stages 0-2."""
        return self.module.state_dict()

    def full_state_dict(self, rank0_only: bool = True) -> dict[str, torch.Tensor]:
        """As stage 3's: ``{name: tensor}`` of ``model.state_dict()`` (CPU clones) on rank 0, or on every rank
        unless ``rank0_only``; elsewhere an empty dict. The same call at every stage; every rank calls it."""
        if rank0_only and self.rank != 0:
            return {}
        return {k: v.detach().clone().cpu() for k, v in self.module.state_dict().items()}
