"""Baselines for ``zerorun bench``: torch's DistributedDataParallel and PyTorch FSDP2 (``fully_shard``) behind
the interface of :class:`~zerorun.zero.engine.ZeroEngine`, so the worker trains them with the same loop.

Interface (what ``worker.py`` uses): ``engine(batch)`` runs the forward, ``engine.backward(loss)`` backpropagates
``loss / grad_accum_steps``, ``engine.step()`` clips, steps the optimizer, zeroes the gradients and returns the
global gradient L2 norm (float); ``engine.optimizer`` (the user's ``torch.optim`` optimizer, for the LR
scheduler), ``engine.num_params``, ``engine.units``, ``engine.memory_bytes()`` and ``engine.comm_stats()``.

- ``ddp``: ``DistributedDataParallel`` over the whole model, gradients all-reduced bucket by bucket during
  backward (``bucket_cap_mb`` = ``zero.bucket_mb``); non-final micro-steps of a step run their forward under
  ``no_sync()``, as DDP's documentation recommends for gradient accumulation. DDP's defaults otherwise
  (``gradient_as_bucket_view=False``: its communication buckets, another 4Ψ bytes, are not counted in
  ``memory_bytes``, which counts parameters, ``.grad`` and optimizer states only).
- ``fsdp2``: ``fully_shard`` applied to the units zerorun's stage 3 would pick (``zero.units``, or chosen by
  parameter count: :func:`zerorun.zero.stage3.pick_units`), innermost first, then to the root; a unit holding
  a weight tied to a module outside it is left to the root (FSDP2 needs tied weights in one group);
  ``reshard_after_forward=True`` (parameters freed after forward and gathered again for backward, as zerorun's
  stage 3 does). Non-final micro-steps of a step run with ``set_requires_gradient_sync(False)`` (FSDP2's
  gradient accumulation without communication: unsharded gradients accumulate locally and are
  reduce-scattered once, on the last micro-step), so both baselines sum gradients in the same order.

Bytes sent are counted at each collective with the ring formulas of ``zerorun/zero/comm.py`` (ZeRO paper §7):
DDP through a comm hook around torch's default all-reduce hook, FSDP2 through its custom all-gather and
reduce-scatter hooks (``set_custom_all_gather``/``set_custom_reduce_scatter``) around torch's defaults.
Time waited on collectives is not observable from outside these wrappers and is reported as ``None``.
The FSDP2 hooks subclass torch's ``DefaultAllGather``/``DefaultReduceScatter`` from the private module
``torch.distributed.fsdp._fully_shard._fsdp_collectives`` (torch 2.13, the version the project pins).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn

from zerorun.zero.engine import ZeroConfig, resolve_optimizer

RUNTIMES = ("ddp", "fsdp2")


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds: the local shard of a DTensor, else the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


class UnitInfo(NamedTuple):
    """An FSDP2 unit: its qualified module name (``""`` for the root) and the module."""

    name: str
    module: nn.Module


class SentBytes:
    """Bytes this rank's collectives sent (ring formulas, ZeRO §7), counted by the baselines' hooks."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.bytes = 0


def _counting_allreduce(sent: SentBytes, bucket):
    """DDP's comm hook: torch's default all-reduce on the default group, counting 2 (N - 1) / N of the bucket
    per rank (ring all-reduce; zerorun/zero/comm.py)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    sent.bytes += int(round(2 * (sent.world_size - 1) / sent.world_size * bucket.buffer().nbytes))
    return allreduce_hook(None, bucket)


class BaselineEngine:
    """Base class of :class:`DDPEngine` and :class:`FSDP2Engine`: the training-step protocol shared by both.
    Subclasses set ``self.model`` (the wrapped module called in forward) and ``self.optimizer``; their
    collectives' hooks count into ``self.sent``. Baselines run fp32 without loss scaling or offload (the recipe
    refuses anything else), so :attr:`loss_scale` is ``None`` and no step is ever skipped."""

    loss_scale = None
    last_step_skipped = False
    skipped_steps = 0

    def __init__(self, module: nn.Module, config: ZeroConfig) -> None:
        self.module = module
        self.config = config
        self.world_size = dist.get_world_size()
        self.sent = SentBytes(self.world_size)
        self.units: list[UnitInfo] = []
        self._micro_step = 0
        self.num_params = sum(p.numel() for p in module.parameters() if p.requires_grad)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped model's forward."""
        return self.model(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate ``loss / grad_accum_steps`` (a scalar tensor).

        Raises:
            RuntimeError: ``loss`` is not a scalar tensor, or more micro-steps than ``grad_accum_steps``
                were run without :meth:`step`.
        """
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise RuntimeError(f"backward needs a scalar loss tensor, got {type(loss).__name__}")
        if self._micro_step >= self.config.grad_accum_steps:
            raise RuntimeError(f"{self._micro_step + 1} backward calls without step(); "
                               f"grad_accum_steps is {self.config.grad_accum_steps}")
        (loss / self.config.grad_accum_steps).backward()
        self._micro_step += 1

    def step(self) -> float:
        """Clip the global gradient L2 norm to ``grad_clip`` (``torch.nn.utils.clip_grad_norm_``), step the
        optimizer, zero the gradients.

        Returns:
            The global gradient L2 norm before clipping (0-d fp32 tensor on the device, as ``ZeroEngine.step``),
            equal on every rank.

        Raises:
            RuntimeError: fewer than ``grad_accum_steps`` backward calls since the last step.
        """
        if self._micro_step != self.config.grad_accum_steps:
            raise RuntimeError(f"step() after {self._micro_step} backward calls; grad_accum_steps is "
                               f"{self.config.grad_accum_steps}")
        params = [p for p in self.module.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, self.config.grad_clip or float("inf"))
        self.optimizer.step()
        self.optimizer.zero_grad()  # torch's default, None: a parameter no rank used is not stepped, as zerorun
        self._micro_step = 0
        return (norm.full_tensor() if hasattr(norm, "full_tensor") else norm).detach().float()

    def memory_bytes(self) -> dict[str, int]:
        """Model-state bytes this rank holds: ``{"params", "grads", "optimizer"}`` in bytes, counted from its
        local tensors (DTensor shards for FSDP2). ``grads`` counts one gradient per trainable parameter (what
        the rank holds after backward); ``optimizer`` every tensor in the optimizer's state."""
        params = sum(_local(p).nbytes for p in self.module.parameters())
        grads = sum(_local(p).nbytes for p in self.module.parameters() if p.requires_grad)
        optim = sum(_local(v).nbytes for state in self.optimizer.state.values() for v in state.values()
                    if isinstance(v, torch.Tensor))
        return {"params": params, "grads": grads, "optimizer": optim}

    @property
    def bytes_sent(self) -> int:
        """Cumulative bytes this rank's gradient and parameter collectives sent."""
        return self.sent.bytes

    def close(self) -> None:
        """Nothing to release (no offload files)."""

    def comm_stats(self) -> dict[str, Any]:
        """Cumulative ``bytes_sent`` (bytes, ring formulas, ZeRO §7) of this rank's gradient and parameter
        collectives; ``bytes_inter_node`` and ``wait_s`` are ``None`` (not observed for these runtimes)."""
        return {"bytes_sent": self.bytes_sent, "bytes_inter_node": None, "wait_s": None}


class DDPEngine(BaselineEngine):
    """torch's ``DistributedDataParallel`` with the user's optimizer over the model's parameters."""

    def __init__(self, model: nn.Module, *, optimizer: str | type, optimizer_kwargs: dict[str, Any],
                 param_groups: list[dict[str, Any]], config: ZeroConfig) -> None:
        from torch.nn.parallel import DistributedDataParallel

        super().__init__(model, config)
        from zerorun.zero.broadcast import ddp_buffer_kwargs

        self.model = DistributedDataParallel(model, bucket_cap_mb=config.bucket_mb,
                                             **ddp_buffer_kwargs(config.broadcast_buffers))

        # the hook's state is the byte counter, never the engine: DDP keeps the hook and its state in C++, where a
        # cycle through them is never freed (Note [Hooks hold their owner weakly] in zerorun/zero/weakhook.py)
        self.model.register_comm_hook(self.sent, _counting_allreduce)
        self.optimizer = resolve_optimizer(optimizer)(param_groups, **optimizer_kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Forward; under ``no_sync()`` on every micro-step but the last of a step (no all-reduce then)."""
        if self._micro_step + 1 < self.config.grad_accum_steps and self.module.training:
            with self.model.no_sync():
                return self.model(*args, **kwargs)
        return self.model(*args, **kwargs)


class FSDP2Engine(BaselineEngine):
    """PyTorch FSDP2: ``fully_shard`` on stage 3's units, then on the root."""

    def __init__(self, model: nn.Module, *, optimizer: str | type, optimizer_kwargs: dict[str, Any],
                 param_groups: list[dict[str, Any]], config: ZeroConfig) -> None:
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

        from zerorun.zero.unit_plan import pick_units

        super().__init__(model, config)
        for t in [*model.parameters(), *model.buffers()]:  # every rank starts from rank 0's values, as DDP does
            dist.broadcast(t.data, 0)
        names = {p: n for n, p in model.named_parameters()}
        group_names = [[names[p] for p in g["params"]] for g in param_groups]
        # a parameter reached from outside its unit (a weight tied across units) must live in the root's group,
        # as zerorun's stage 3 keeps it (Note [Units] in zero/stage3.py): FSDP2 refuses it in two groups
        reached: dict[nn.Parameter, list[str]] = {}
        for qualified, p in model.named_parameters(remove_duplicate=False):
            reached.setdefault(p, []).append(qualified)
        units = [(name, unit) for name, unit in pick_units(model, tuple(config.units))
                 if all(q.startswith(name + ".") for p in unit.parameters() for q in reached[p])]
        n, sent = self.world_size, self.sent

        class CountingAllGather(DefaultAllGather):
            def __call__(self, output_tensor, input_tensor, group, async_op=False):
                sent.bytes += (n - 1) * input_tensor.nbytes  # ring all-gather (zerorun/zero/comm.py)
                return super().__call__(output_tensor, input_tensor, group, async_op)

        class CountingReduceScatter(DefaultReduceScatter):
            def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
                sent.bytes += (n - 1) * output_tensor.nbytes  # ring reduce-scatter
                return super().__call__(output_tensor, input_tensor, group, op, async_op)

        # innermost first: a unit inside another unit is sharded on its own before its parent
        for name, unit in sorted(units, key=lambda u: u[0].count("."), reverse=True):
            fully_shard(unit, reshard_after_forward=True)
        fully_shard(model, reshard_after_forward=True)
        for module in [unit for _, unit in units] + [model]:
            module.set_custom_all_gather(CountingAllGather())
            module.set_custom_reduce_scatter(CountingReduceScatter())
        self.units = [UnitInfo(name, unit) for name, unit in units] + [UnitInfo("", model)]
        self.model = model
        sharded = dict(model.named_parameters())  # fully_shard replaced the parameters by DTensors
        groups = [dict(g, params=[sharded[name] for name in names_]) for g, names_ in zip(param_groups, group_names)]
        self.optimizer = resolve_optimizer(optimizer)(groups, **optimizer_kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Forward; gradient reduction is off for every micro-step but the last of a step."""
        if self.module.training and self.config.grad_accum_steps > 1:
            self.model.set_requires_gradient_sync(self._micro_step + 1 == self.config.grad_accum_steps)
        return self.model(*args, **kwargs)


def initialize(runtime: str, model: nn.Module, *, optimizer: str | type = "AdamW",
               optimizer_kwargs: dict[str, Any] | None = None, param_groups: list[dict[str, Any]] | None = None,
               config: ZeroConfig | None = None) -> BaselineEngine:
    """Wrap ``model`` (built identically on every rank, on this rank's device) for ``runtime`` (``"ddp"`` or
    ``"fsdp2"``) on the default process group, with the user's optimizer: the same arguments as
    :func:`zerorun.zero.initialize`. ``config.stage`` is ignored; ``config.units`` picks FSDP2's units.

    Raises:
        ValueError: unknown runtime or optimizer, or a ``zero.units`` class the model does not have.
        RuntimeError: ``torch.distributed`` is not initialized.
    """
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: call dist.init_process_group first")
    from zerorun.zero.engine import default_param_groups

    config = config or ZeroConfig()
    optimizer_kwargs = dict(optimizer_kwargs or {})
    if param_groups is None:
        param_groups = default_param_groups(model, optimizer_kwargs.pop("weight_decay", 0.0))
    cls = {"ddp": DDPEngine, "fsdp2": FSDP2Engine}.get(runtime)
    if cls is None:
        raise ValueError(f"unknown runtime {runtime!r}: expected one of {', '.join(RUNTIMES)}")
    return cls(model, optimizer=optimizer, optimizer_kwargs=optimizer_kwargs, param_groups=param_groups,
               config=config)
