"""fp32 master slices and the user's optimizer over them, in device memory (:class:`Masters`) or in host memory
(:class:`CpuMasters`); the disk variant is ``disk.py``'s. The design notes are in ``offload.py``."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from zerorun.zero.precision import wide_or
from zerorun.zero.staging import HostStaging, typed_views


def _group_params(params: list[torch.Tensor], group_of: list[int], group_options: list[dict]) -> list[dict]:
    groups = [dict(opts, params=[]) for opts in group_options]
    for p, g in zip(params, group_of):
        groups[g]["params"].append(p)
    return [g for g in groups if g["params"]]


def probe_spec(optimizer: torch.optim.Optimizer) -> dict[str, tuple[bool, torch.dtype, tuple]]:
    """:meth:`Masters.state_spec` of ``optimizer``'s class and options, learnt by stepping a fresh instance
    once on a 3-element probe with a zero gradient (for a rank that holds no stepped parameter)."""
    probe = torch.zeros(3, requires_grad=True)
    opt = type(optimizer)([probe], **optimizer.defaults)
    probe.grad = torch.zeros(3)
    opt.step()
    return {k: (v.shape == probe.shape, v.dtype, tuple(v.shape)) for k, v in opt.state[probe].items()
            if isinstance(v, torch.Tensor)}


def _state_bytes(state: dict) -> int:
    return sum(v.nbytes for s in state.values() for v in s.values() if isinstance(v, torch.Tensor))


def multi_tensor_kwargs(optimizer_cls: type, kwargs: dict[str, Any], host: bool) -> dict[str, Any]:
    """``kwargs`` with the multi-tensor implementation chosen where the user chose none (Note [One optimizer
    step]): ``fused=True`` for a step in host memory (``host``) where torch has a fused CPU kernel for
    ``optimizer_cls`` (Adam, AdamW, SGD, Adagrad), else ``foreach=True``; unchanged when the user set
    ``foreach`` or ``fused``, when the class's ``__init__`` names neither (a user's class), and where torch's
    multi-tensor paths refuse the options (a tensor ``lr`` without ``capturable``, ``differentiable``: torch's
    own default path then, as in plain PyTorch; found by review: torch's error named a ``foreach`` never set)."""
    import inspect

    named = inspect.signature(optimizer_cls.__init__).parameters
    if ("foreach" in kwargs or "fused" in kwargs or "foreach" not in named or kwargs.get("capturable")
            or kwargs.get("differentiable") or isinstance(kwargs.get("lr"), torch.Tensor)):
        return dict(kwargs)
    fused_cpu = host and "fused" in named and optimizer_cls in (torch.optim.Adam, torch.optim.AdamW,
                                                                 torch.optim.SGD, torch.optim.Adagrad)
    return {**kwargs, "fused": True} if fused_cpu else {**kwargs, "foreach": True}


def scalar_state(value: torch.Tensor, param: torch.Tensor, group: dict) -> torch.Tensor:
    """A copy of scalar optimizer state ``value`` (Adam's ``step``) placed as torch keeps it (its
    ``Optimizer.load_state_dict``): on the CPU unless the group is ``capturable`` or ``fused`` (then on
    ``param``'s device, fp32). Note [Scalar states on the CPU]: a ``step`` on a GPU costs a host read per
    parameter per step (the non-capturable optimizers read it with ``.item()``)."""
    if group.get("capturable") or group.get("fused"):
        return value.to(device=param.device, dtype=torch.float32, copy=True)
    return value.to(device="cpu", copy=True)


# Note [One optimizer step]: the step runs the optimizer once over every segment of every buffer of this rank,
# multi-tensor (``foreach=True``, or ``fused=True`` for a step in host memory where torch has the CPU kernel:
# Adam, AdamW, SGD, Adagrad; :func:`multi_tensor_kwargs`, unless the user chose either), as torch's own loop does
# (``clip_grad_norm_`` then ``AdamW(foreach=True).step()``): the global norm in a bounded number of kernels
# (``gradnorm.global_sum_of_squares``), the clip factor on the device (``clamp(max_norm / (norm + 1e-6), max=1)``,
# times 1/scale with fp16), multiplied into the gradients with one kernel, no host read (fp16: one, the
# overflow decision). The step used to run ``optimizer.step()`` once per flat buffer on the mixed-precision
# and offload paths, each walking every parameter: 400 one-parameter buffers took 3.4x torch's time in bf16
# (benchmarks/optimizer_step.py). Mixed precision: the fp32 gradients of all this rank's slices are one
# transient tensor during the step (4 bytes per element of the slices; they were one buffer's at a time),
# filled by one ``_foreach_copy_`` (cast) and written back the same way. The gradients are given to the
# segments (``.grad``) at every step and taken away after it, so a user's ``optimizer.zero_grad()`` changes
# nothing (issue 33 item 9).
#
# Note [Scalar states on the CPU]: torch keeps Adam's ``step`` (and the other scalar states) on the CPU unless
# the optimizer is ``capturable`` or ``fused`` (``Optimizer.load_state_dict`` keeps them where they were
# loaded): a non-capturable step reads each one with ``.item()``, free on the CPU, a device sync per parameter
# per step on a GPU. Resume (``state.py``) loads them on the CPU and :func:`scalar_state` places them as torch
# does.


class Masters:
    """fp32 master slices in device memory and the user's optimizer over them (``offload_optimizer: none``).

    Note [Unused parameters]: DDP (``find_unused_parameters=True``) leaves the gradient of a parameter that no
    rank used in a step ``None``, and torch's optimizers skip such a parameter: no weight decay, no momentum,
    and its own ``step`` count (Adam's bias correction) does not advance. To step exactly as that, the
    optimizer is not built over one master per flat buffer but over per-parameter segments: views of this
    rank's master slice, one per parameter of the buffer (its range in this slice, possibly empty; padding is
    in none), each a parameter of the optimizer with its own state. The reducer learns which parameters got
    a gradient on some rank (a gradient hook ran, in any micro-step): its own ones are a set on the host, and
    the OR over the ranks is a flag per parameter in the sum the reducer already makes on the host at the end
    of the step's last backward for late gradients (Note [Per-parameter readiness] in ``reducer.py``, Note
    [Agreements on the host] in ``comm.py``): 8 bytes per parameter more, no host sync. At the step a segment
    gets its gradient as ``.grad`` (a view of the reduced slice, given at every step: a user's
    ``optimizer.zero_grad()`` changes nothing) or ``None``; the optimizer then does what torch does per
    parameter. A parameter used on some ranks only gets its mean gradient (zeros from the others), as under
    DDP. The cost: the optimizer loops over parameters, not buffers, as a plain torch optimizer over the model
    does (Note [One optimizer step]). Checkpoints keep their format
    (Note [Checkpoint layout] in ``state.py``): per-element states per parameter range as before, and the
    scalar states (``step``) per parameter, as they always were stored; a parameter no step has touched yet
    is written with zeros and ``step`` 0 and loads as no state (an optimizer that makes its state at
    construction, Adagrad, keeps it; SGD has no ``step``: its zero momentum is loaded, which differs from
    no state only with ``dampening``).

    Args:
        slices: this rank's parameter slices, one per flat buffer (1-D, any float dtype); updated in place.
        group_of: the optimizer param group of each slice.
        group_options: per-group options (``lr``, ``weight_decay``, ...), as in a torch param group.
        optimizer_cls, optimizer_kwargs: the user's elementwise ``torch.optim`` optimizer.
        alias_grads: fp32 training only: the gradient slices (same shapes); the masters then are the
            parameter slices themselves, stepped in place.
        segments: per slice, the ``(start, end)`` range in it of each parameter of the flat buffer, in layout
            order (``start == end``: none of it here); ``None``: one segment per slice (a test's masters).
    """

    def __init__(self, slices: list[torch.Tensor], group_of: list[int], group_options: list[dict],
                 optimizer_cls: type, optimizer_kwargs: dict[str, Any],
                 alias_grads: list[torch.Tensor] | None = None,
                 segments: list[list[tuple[int, int]]] | None = None) -> None:
        self.slices = slices
        self.alias = alias_grads is not None
        self.numels = [s.numel() for s in slices]
        self.dtypes = [wide_or(s.dtype, torch.float32) for s in slices]  # Note [Wide parameters] in precision.py
        self.params = self._new_masters(slices)
        self.bounds = segments if segments is not None else [[(0, s.numel())] for s in slices]
        self.segments = [[m[a:b].requires_grad_(True) for a, b in bounds]
                         for m, bounds in zip(self.params, self.bounds)]
        flat = [seg for segs in self.segments for seg in segs]
        groups = [group_of[i] for i, segs in enumerate(self.segments) for _ in segs]
        kwargs = multi_tensor_kwargs(optimizer_cls, optimizer_kwargs, host=self._host_step())
        self.optimizer = optimizer_cls(_group_params(flat, groups, group_options), **kwargs)
        self.eager = bool(self.optimizer.state)  # Adagrad makes its state at construction
        self.stepped = False  # whether any parameter has been stepped (the same on every rank)

    def _host_step(self) -> bool:
        """Whether the optimizer steps in host memory (offload): the fused CPU kernels then."""
        return False

    def _new_masters(self, slices: list[torch.Tensor]) -> list[torch.Tensor]:
        """One 1-D master per slice (fp32, float64 for a float64 slice): the slices themselves (aliased), else
        views of one new allocation (:func:`~zerorun.zero.staging.typed_views`)."""
        if self.alias:
            return [s.detach() for s in slices]
        _, views, _ = typed_views(self.numels, self.dtypes, slices[0].device)
        torch._foreach_copy_(views, [s.detach().reshape(-1) for s in slices])
        return views

    def _give_grads(self, grads: Sequence[torch.Tensor], used: list[list[bool]] | None) -> bool:
        """Set the ``.grad`` of every segment to its part of ``grads[i]`` (1-D, slice ``i``'s shape) where its
        parameter was used (``used[i][k]``; ``None``: all), else ``None``. Returns whether any got one."""
        any_used = False
        for i, (grad, bounds, segs) in enumerate(zip(grads, self.bounds, self.segments)):
            mine = used[i] if used is not None else None
            for k, ((a, b), seg) in enumerate(zip(bounds, segs)):
                on = b > a and (mine is None or mine[k])
                seg.grad = grad[a:b] if on else None
                any_used |= on
        return any_used

    def _drop_grads(self) -> None:
        for segs in self.segments:
            for seg in segs:
                seg.grad = None

    def _step_on(self, grads: Sequence[torch.Tensor], used: list[list[bool]] | None) -> None:
        """One optimizer step over every segment (Note [One optimizer step]) on ``grads`` (one per slice, in its
        master's dtype, on the masters' device, already multiplied by the step's factor)."""
        if self._give_grads(grads, used):
            self.stepped = True
            self.optimizer.step()
        self._drop_grads()

    def step(self, grads: Sequence[torch.Tensor], coef: torch.Tensor | None,
             used: list[list[bool]] | None = None) -> None:
        """Step on ``grads`` (this rank's gradient slices, any float dtype) times ``coef`` (0-d fp32/fp64 tensor on
        the gradients' device: clipping and loss-scale factor; ``None`` for 1), then write the masters into
        the parameter slices. ``used[i][k]``: whether parameter ``k`` of buffer ``i`` got a gradient on some
        rank (Note [Unused parameters]; ``None``: all did). No host read (Note [One optimizer step])."""
        grads = list(grads)
        if self.alias:
            if coef is not None:
                torch._foreach_mul_(grads, coef)
            self._step_on(grads, used)
            return
        _, full, flats = typed_views(self.numels, self.dtypes, self.params[0].device)  # transient, the masters' dtypes
        torch._foreach_copy_(full, [g.reshape(-1) for g in grads])
        if coef is not None:
            for flat in flats:
                flat.mul_(coef)
        self._step_on(full, used)
        torch._foreach_copy_(self.slices, self.params)

    def master_slices(self) -> list[torch.Tensor]:
        """This rank's master values (fp32; float64 for a float64 buffer), one 1-D tensor per flat buffer (views:
        do not modify)."""
        return [m.detach() for m in self.params]

    def state_slices(self) -> list[dict[str, torch.Tensor]]:
        """The optimizer state of each optimizer parameter, a segment of a master (``{name: tensor}``, e.g.
        Adam's ``exp_avg``, ``exp_avg_sq``, ``step``); empty where it has not stepped."""
        return [dict(self.optimizer.state.get(seg, {})) for segs in self.segments for seg in segs]

    def param_states(self) -> list[list[dict[str, torch.Tensor]]]:
        """Per flat buffer, per parameter of it (layout order): the optimizer state of this rank's range of the
        parameter (``{name: tensor}``: per-element states 1-D of the range's length, scalars as they are; the
        optimizer's own tensors, do not modify); ``{}`` where it has none (never stepped, or no range here)."""
        return [[dict(self.optimizer.state.get(seg, {})) if seg.numel() else {} for seg in segs]
                for segs in self.segments]

    def has_state(self) -> bool:
        """Whether the optimizer keeps any state yet (the same on every rank)."""
        return self.stepped or self.eager

    def param_scalars(self) -> list[list[dict[str, torch.Tensor] | None]]:
        """Per flat buffer, per parameter of it: the states that are not per element (Adam's ``step``) of this
        rank's range of the parameter; ``None`` where it has no state (never stepped, or no range here)."""
        return [[{k: v for k, v in self.optimizer.state[seg].items() if isinstance(v, torch.Tensor)
                  and v.shape != seg.shape} if seg.numel() and seg in self.optimizer.state else None
                 for seg in segs] for segs in self.segments]

    def state_spec(self) -> dict[str, tuple[bool, torch.dtype, tuple]]:
        """``{name: (per element, dtype, shape)}`` of the optimizer's state tensors (a per-element one's shape is
        the probe's), the same on every rank; ``{}`` while :meth:`has_state` is false."""
        if not self.has_state():
            return {}
        for segs in self.segments:
            for seg in segs:
                state = self.optimizer.state.get(seg) if seg.numel() else None
                if state:
                    return {k: (v.shape == seg.shape, v.dtype, tuple(v.shape) if v.shape != seg.shape else (3,))
                            for k, v in state.items() if isinstance(v, torch.Tensor)}
        return probe_spec(self.optimizer)

    def buffer_states(self) -> list[dict[str, torch.Tensor]]:
        """The optimizer state of each flat buffer's master, in :attr:`slices` order (``{name: tensor}``: states
        with one element per master element are 1-D like the master, zeros where a parameter has no state; a
        scalar such as ``step`` is the first stepped parameter's, see :meth:`param_states` for each one's);
        empty dicts where no parameter of the buffer has stepped. New tensors."""
        out = []
        for m, bounds, segs in zip(self.params, self.bounds, self.segments):
            joined: dict[str, torch.Tensor] = {}
            for (a, b), seg in zip(bounds, segs):
                for key, v in (self.optimizer.state.get(seg, {}) if b > a else {}).items():
                    if not isinstance(v, torch.Tensor):
                        continue
                    if v.shape != seg.shape:  # a scalar: the first stepped parameter's
                        joined.setdefault(key, v.clone())
                        continue
                    if key not in joined:
                        joined[key] = torch.zeros(m.shape, dtype=v.dtype, device=v.device)
                    joined[key][a:b].copy_(v)
            out.append(joined)
        return out

    def load(self, values: Sequence[torch.Tensor], states: Sequence[dict[str, torch.Tensor]] | None,
             param_scalars: list[list[dict[str, torch.Tensor] | None]] | None = None) -> None:
        """Overwrite the masters with ``values`` (one 1-D fp32 tensor per flat buffer, shaped as
        :meth:`master_slices`; may be those very tensors) and the optimizer state with ``states`` (per buffer,
        as :meth:`buffer_states` gives them; ``None`` or empty dicts: no state, as before the first step), then
        write the masters into the parameter slices (:meth:`write_params`). ``param_scalars[i][k]``: the
        scalar states of parameter ``k`` of buffer ``i`` (``None``: that parameter has no state); ``None``:
        each buffer's scalars stand for all its parameters. Used to resume a checkpoint."""
        with torch.no_grad():
            for m, v in zip(self.params, values):
                m.copy_(v.reshape(m.shape))
        self.optimizer.state.clear()
        self.stepped = False
        group_of = {id(p): g for g in self.optimizer.param_groups for p in g["params"]}
        for i, (m, state) in enumerate(zip(self.params, states or [{}] * len(self.params))):
            if not state:
                continue
            for k, ((a, b), seg) in enumerate(zip(self.bounds[i], self.segments[i])):
                scalars = {key: v for key, v in state.items() if v.shape != m.shape}
                if param_scalars is not None:
                    scalars = param_scalars[i][k]
                if b == a or scalars is None:
                    continue
                self.stepped = True
                self.optimizer.state[seg] = {**{key: scalar_state(v, seg, group_of[id(seg)])
                                                for key, v in scalars.items()},
                                             **{key: v[a:b].to(m.device, copy=True) for key, v in state.items()
                                                if v.shape == m.shape}}
        self.write_params()

    def set_values(self, values: Sequence[torch.Tensor]) -> None:
        """Overwrite the masters with ``values`` (as :meth:`load`), keeping the optimizer state, and write them
        into the parameter slices."""
        with torch.no_grad():
            for m, v in zip(self.params, values):
                m.copy_(v.reshape(m.shape))
        self.write_params()

    def write_params(self) -> None:
        """Write the masters into this rank's parameter slices, cast to the parameters' dtype (nothing to do
        when they are the same tensors: fp32 without offload)."""
        if not self.alias:
            torch._foreach_copy_(self.slices, self.params)

    def memory_bytes(self) -> dict[str, int]:
        """``{"optimizer": bytes of states and separate fp32 masters in device memory, "host": in host memory
        off the device, "disk": in files}``."""
        own = 0 if self.alias else sum(m.nbytes for m in self.params)
        return {"optimizer": own + _state_bytes(self.optimizer.state), "host": 0, "disk": 0}

    def close(self) -> None:
        """Release files and threads (nothing to release here)."""


class CpuMasters(Masters):
    """Masters and optimizer states in host memory, pinned when the parameters are on CUDA, one step on the
    CPU (fused or foreach, Note [One optimizer step]) over gradients staged through reused host buffers (Note
    [Offload copies] in ``staging.py``). Arguments as :class:`Masters` (never aliased)."""

    def __init__(self, slices, group_of, group_options, optimizer_cls, optimizer_kwargs, segments=None) -> None:
        self.device = slices[0].device
        self.pin = self.device.type == "cuda"
        super().__init__(slices, group_of, group_options, optimizer_cls, optimizer_kwargs, segments=segments)
        self.staging = HostStaging(self.numels, [s.dtype for s in slices], self.device, self.dtypes)

    def _host_step(self) -> bool:
        return True

    def _new_masters(self, slices: list[torch.Tensor]) -> list[torch.Tensor]:
        _, views, _ = typed_views(self.numels, self.dtypes, pin=self.pin)
        for m, s in zip(views, slices):
            m.copy_(s.detach().reshape(-1))
        return views

    def step(self, grads, coef, used=None) -> None:
        self.staging.settle()  # the last step's copies out read the masters
        self._step_on(self.staging.fetch(list(grads), coef), used)
        self.staging.send(self.params, self.slices)

    def load(self, values, states, param_scalars=None) -> None:
        self.staging.settle()
        super().load(values, states, param_scalars)

    def set_values(self, values) -> None:
        self.staging.settle()
        super().set_values(values)

    def memory_bytes(self) -> dict[str, int]:
        held = sum(m.nbytes for m in self.params) + _state_bytes(self.optimizer.state)
        if self.pin:
            return {"optimizer": 0, "host": held, "disk": 0}
        return {"optimizer": held, "host": 0, "disk": 0}  # a CPU-only machine: the host is the device
