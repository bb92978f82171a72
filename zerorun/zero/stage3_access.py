"""Stage 3: parameters used outside their unit, and the user's ways to read and write partitioned parameters.

Note [Parameters at rest]: between uses a stage-3 unit's flat storage is freed. Its parameters then hold a
placeholder of their shape that reads as NaN and refuses in-place writes (a one-element NaN tensor expanded
with stride 0): no access can touch freed memory (a read of a freed storage was a SIGSEGV). The parameter
objects stay the user's (same ``nn.Parameter``, hooks and ``requires_grad``); only their class gains a
``__torch_function__`` (:class:`ZeroParameter`) that sees every torch operation on them and, when the
parameter's unit is not gathered:

- inside a forward (or backward) of the model, gathers the unit (every rank runs the same forward, so every
  rank issues the same all-gather) and records it as used by the unit running at that moment, which from
  then on gathers it together with its own parameters, in forward and in backward (Note [External
  parameters]): a weight penalty in the loss, a weight tied by attribute into another unit, a norm logged in
  ``forward`` give stage 0's result;
- anywhere else (between steps, on one rank), raises a RuntimeError naming the parameter and the way out:
  :meth:`Stage3Engine.gathered_parameters` (every rank), or ``full_state_dict()``.

Metadata (``shape``, ``dtype``, ``requires_grad``, ``numel()``, hooks) never needs the values and passes;
reading ``p.data`` counts as a use (what is done with the plain tensor it returns is not seen). A
reference to ``p.data`` taken while the unit was gathered and used after it was freed reads the placeholder:
NaN, and torch's own error (overlapping memory) on a write, never a silent loss or a crash.

Note [Plain while gathered]: the guard costs Python on every torch operation on a parameter, and it is needed
only while the parameter's values are absent. So a parameter is a :class:`ZeroParameter` only at rest: when
its unit's all-gather is done (``UnitState.GATHERED``) its class is switched back to ``nn.Parameter``
(``Unit.unshard``), and to :class:`ZeroParameter` again when the unit is freed (``Unit.reshard``), before
its storage goes. While a unit computes, its parameters are ordinary parameters holding views of the gathered
flat buffer: no per-op Python (a model of many small ops pays nothing per op, as at stage 2) and
``torch.compile`` traces plain tensors. A use while a prefetch is in flight (``GATHERING``) is still seen,
and waits. Outer units (Note [Outer units] in ``stage3_outer.py``) stay guarded while gathered: their
schedule is learned from who reads them. Only the Python class changes: the object, its ``TensorImpl``, its
hooks and what autograd saved stay the same.

Note [External parameters]: ``register_external_parameter(module, param)`` declares, before or after
``initialize``, that ``module``'s forward reads ``param`` of another unit (DeepSpeed's name for the same):
the unit of ``module`` then gathers ``param``'s unit along with itself, pinned until it frees itself,
without waiting for the first use to be discovered.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn as nn

from zerorun.zero.torch_internals import in_backward
from zerorun.zero.units import UnitState


#: torch functions that read only metadata (or manage hooks) and never the values.
_METADATA = frozenset({"__get__", "__set__", "size", "dim", "numel", "nelement", "element_size", "__hash__",
                       "is_floating_point", "is_complex", "requires_grad_", "register_hook",
                       "register_post_accumulate_grad_hook", "__len__", "stride", "is_contiguous",
                       "grad", "backward"})  # torch.autograd's: their graph reads the values, its hooks gather them
_EXTERNAL_ATTR = "_zerorun_external_params"
_DATA = torch.Tensor.data


def register_external_parameter(module: nn.Module, param: nn.Parameter) -> None:
    """Declare that ``module``'s forward reads ``param``, a parameter of another stage-3 unit (Note [External
    parameters]): at stage 3, ``module``'s unit gathers ``param``'s unit with itself. Call it in the model's
    ``__init__`` or at any time; a no-op at stages 0-2."""
    if not isinstance(param, nn.Parameter):
        raise TypeError(f"register_external_parameter needs an nn.Parameter, got {type(param).__name__}")
    module.__dict__.setdefault(_EXTERNAL_ATTR, []).append(param)
    guard = module.__dict__.get("_zerorun_guard", lambda: None)()  # a stage-3 engine's, while it lives
    if guard is not None:
        guard.declare_external(module, param)


def declared_externals(model: nn.Module) -> list[tuple[nn.Module, nn.Parameter]]:
    """``(module, param)`` for every :func:`register_external_parameter` call on a module of ``model``."""
    return [(m, p) for m in model.modules() for p in m.__dict__.get(_EXTERNAL_ATTR, [])]


class ZeroParameter(nn.Parameter):
    """The class a stage-3 parameter takes (Note [Parameters at rest]); behaves as ``nn.Parameter`` otherwise.
    ``_zerorun_use(self)`` (set per parameter by the engine) is called before any value access."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # reading ``p.data`` hands out the values (a write through it would bypass this guard)
        name = getattr(func, "__name__", "")
        if name not in _METADATA or (name == "__get__" and getattr(func, "__self__", None) is _DATA):
            for a in (*args, *kwargs.values()):
                for b in a if isinstance(a, (list, tuple)) else (a,):
                    if isinstance(b, ZeroParameter):
                        b._zerorun_use(b, func)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


def adopt(p: nn.Parameter, use) -> bool:
    """Give ``p`` the class :class:`ZeroParameter` and the callback ``use(p, func)``; ``False`` (left as it is)
    for a parameter subclass with a ``__torch_function__`` of its own."""
    if type(p) is not nn.Parameter:
        return type(p) is ZeroParameter
    p.__class__ = ZeroParameter
    p._zerorun_use = use
    return True


def held_by_stage3(p: nn.Parameter) -> bool:
    """Whether a stage-3 engine partitioned ``p`` (at rest or gathered: Note [Plain while gathered])."""
    return "_zerorun_use" in p.__dict__


def placeholder(p: torch.Tensor) -> torch.Tensor:
    """A tensor of ``p``'s shape, dtype and device that reads as NaN (0 for integers) and refuses in-place
    writes, backed by one element (Note [Parameters at rest])."""
    one = torch.full((1,), float("nan") if p.is_floating_point() else 0, dtype=p.dtype, device=p.device)
    return one.expand(p.shape) if p.dim() else one.view(())


class ParameterGuard:
    """What the at-rest guard does when a stage-3 parameter's values are used (Notes [Parameters at rest],
    [External parameters]): gather its unit inside a forward or backward, else refuse. Owned by the engine.

    Attributes:
        unit_of: each parameter's unit.
    """

    def __init__(self, unit_of: dict[nn.Parameter, Any], sched, names: dict[nn.Parameter, str],
                 world_size: int) -> None:
        self.unit_of, self.sched, self.names, self.world_size = unit_of, sched, names, world_size
        self.warned: set = set()

    def use(self, p: nn.Parameter, func: Any) -> None:
        """Note [Parameters at rest]: ``p``'s values are about to be read or written by ``func``.

        Raises:
            RuntimeError: outside a forward or backward, naming the parameter and the ways out.
        """
        unit = self.unit_of.get(p)
        if unit is not None and unit.held and not (self.sched.active or in_backward()):
            raise self.at_rest(p, func)  # Note [Kept from forward to backward]: as at rest until its backward
        if unit is None or (unit.state is UnitState.GATHERED and not unit.outer):
            return
        if unit.outer and self.sched.outer.use(unit, func):  # Note [Outer units]
            return
        if unit.state is UnitState.GATHERING:  # a prefetch in flight
            unit.unshard()
            return
        active = self.sched.active
        if active or in_backward():
            holder = active[-1] if active else self.sched.root
            if unit is not holder and unit not in holder.external:
                holder.external.append(unit)
                if p not in self.warned:
                    self.warned.add(p)
                    warnings.warn(f"stage 3: parameter {self.names.get(p, '?')!r} is used outside its unit "
                                  f"({unit.name or '<root>'}) by {holder.name or 'the root module'}: it is "
                                  "gathered with that unit from now on (declare it with "
                                  "zerorun.zero.register_external_parameter to skip this discovery)", stacklevel=3)
            unit.unshard()
            unit.pinned_by.add(holder)
            return
        raise self.at_rest(p, func)

    def at_rest(self, p: nn.Parameter, func: Any) -> RuntimeError:
        """The error for a use of ``p``'s values outside a forward or backward (Note [Parameters at rest])."""
        what = getattr(func, "__name__", func)
        what = ".data" if what == "__get__" else what  # the only descriptor the guard sees (p.data)
        return RuntimeError(
            f"stage 3: parameter {self.names.get(p, '?')!r} is partitioned (each rank holds 1/{self.world_size} of "
            f"it between uses) and {what} used its values outside a forward or backward: "
            "read or write it inside `with engine.gathered_parameters([param], modifier_rank=0):` on every rank "
            "(modifier_rank: the rank whose writes are kept), or read engine.full_state_dict(); to call a module "
            "that holds it directly (an LM head in a generation loop), name that module in zero.units")

    def declare_external(self, module: nn.Module, param: nn.Parameter) -> None:
        """Note [External parameters]: the unit running ``module`` gathers ``param``'s unit with itself."""
        unit = self.unit_of.get(param)
        owners = [u for u in self.sched.units if not u.persistent and not u.is_root
                  and any(m is module for m in u.module.modules())]
        holder = owners[-1] if owners else self.sched.root  # the innermost unit around module (or it)
        if unit is not None and unit is not holder and not unit.persistent and unit not in holder.external:
            holder.external.append(unit)
        if unit is not None and unit.outer and holder.is_root:  # Note [Outer units]: stays with the root
            self.sched.outer.declare(unit)


def state_dict_guard(module: nn.Module, prefix: str, keep_vars: bool) -> None:
    """A state-dict pre-hook of a stage-3 model: ``module.state_dict()`` would hold partitioned parameters.

    Raises:
        RuntimeError: unless ``keep_vars`` (the engine's own walk), naming the ways out.
    """
    if not keep_vars:
        raise RuntimeError("stage 3: engine.module.state_dict() would hold partitioned parameters; call "
                           "engine.full_state_dict() on every rank (rank 0 gets the full values) or read "
                           "parameters inside engine.gathered_parameters(...)")


def full_state_dict(module: nn.Module, units: list, keep: bool) -> dict[str, torch.Tensor]:
    """``module``'s ordinary (unsharded) state dict, gathered unit by unit (every rank calls it): ``{name:
    tensor}`` with the keys and shapes of ``module.state_dict()`` (CPU clones, in the parameters' dtype) when
    ``keep``, else an empty dict."""
    keyed = module.state_dict(keep_vars=True)
    out: dict[str, torch.Tensor] = {}
    for unit in units:
        unit.unshard()
        ids = {id(p) for buf in unit.buffers for p in buf.params}
        out.update({k: t.detach().clone().cpu() for k, t in keyed.items() if keep and id(t) in ids})
        unit.reshard()
    if not keep:
        return {}
    return {k: out[k] if k in out else t.detach().clone().cpu() for k, t in keyed.items()}
