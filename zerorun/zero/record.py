"""Recording a model's construction on the meta device, and checking that the record is complete.

Note [What the recording sees]: :func:`record` runs the user's factory with two modes on:

* a function mode (:class:`_MetaFactories`) that sends torch's tensor factories (``empty``, ``zeros``,
  ``full``, ``linspace``, ``arange``, ``eye``, ``randn``, ...) to the meta device unless the call names a
  device. Unlike ``with torch.device("meta")`` it leaves torch's default device alone, so construction code
  cannot tell it is being recorded: ``torch.tensor([]).device`` is still ``cpu`` (``transformers`` skips its
  ``_init_weights`` when it sees the meta device there). Factories that take *data* (``torch.tensor``,
  ``as_tensor``, ``asarray``, ``from_numpy``) build real tensors: their values come from Python or numpy,
  not from an aten op, so no replay could reproduce them. They are small (the data already exists in
  Python), stay real in the model, and keep their values. Real data going into a meta tensor
  (``meta.new_tensor(data)``, ``param.data = real``) becomes a logged copy of it.
* a dispatch mode (:class:`_Recorder`) that logs every aten op touching a meta tensor. A real tensor read
  by such an op is logged as a copy taken at that moment (a later in-place change of the real tensor does not
  leak into the replay) and the op runs on its meta image; an op that writes into a real tensor from meta
  data cannot be recorded (the real tensor would keep wrong values) and stops the recording.

Construction code must not be able to tell that it is recorded: while recording, ``Tensor.is_meta`` says
``False`` (``torch.nn.init.trunc_normal_``, ``orthogonal_`` and ``sparse_`` return at once on a meta tensor,
leaving torch's default values where normal construction has theirs). The property is patched on
``torch.Tensor`` for the duration of the factory, process-wide: another thread building tensors at the same
time would see it too.

Note [Shadow values]: construction code may need values: a drop-path schedule ``[r.item() for r in
torch.linspace(0, 0.1, depth)]``, a check ``if mask.any()``. The recorder keeps a real shadow (on the CPU) of
every small storage (at most ``SHADOW_NUMEL`` elements) whose values follow from ops that draw no random
numbers (an op tagged ``nondeterministic_seeded`` or one on a storage without a shadow drops the shadows of
what it writes). An op that cannot run on meta tensors because it needs values runs on the shadows of its
inputs instead, when they all have one; its result is what normal construction computes, and the op is
logged like any other. Values that depend on random numbers have no shadow (reading them needs the draws in
order), so such code (``trunc_normal_``'s rejection loop in recent torch) still makes the model build normally.

The record is then verified rather than trusted (:func:`check_complete`): every meta parameter and buffer
must have been created by a logged op (a meta tensor whose data came in some other way, e.g. an op that
bypasses Python dispatch, is caught here), and the global generator must not have moved (random numbers
drawn on real tensors cannot be replayed). Anything that fails, including construction code that needs
values without a shadow (``.item()`` on a randomly initialized weight, ``.tolist()`` or ``.numpy()``, which
bypass dispatch) and so raises on meta tensors, makes
:func:`~zerorun.zero.deferred.deferred_init` build the model normally instead, with a warning: the values are
then right, only the memory saving is lost.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

_DATA_FACTORIES = {torch.tensor, torch.as_tensor, torch.asarray, torch.from_numpy, torch.frombuffer,
                   torch.Tensor.new_tensor}
_DATA_DESCRIPTOR = torch._C.TensorBase.__dict__["data"]
_GRAD_HOOKS = {"_backward_hooks": "register_hook", "_post_accumulate_grad_hooks": "register_post_accumulate_grad_hook"}
_META_FACTORIES = {f for f in _device_constructors() if f not in _DATA_FACTORIES and "sparse" not in f.__name__
                   and f.__name__ not in ("nested_tensor", "empty_quantized")}


class Unrecordable(RuntimeError):
    """Construction did something a replay cannot reproduce (the message says what)."""


@dataclasses.dataclass
class Record:
    """A recorded construction: the aten ops in order (``(op, args, kwargs, outputs)``, meta tensors standing
    for storages to be made real), the generator states at the first op (``cpu``, and ``cuda`` when the
    construction device is a GPU), the construction ``device`` (torch's default device during the factory:
    where normal construction would have put the tensors), and ``place``: where stage 3 keeps the
    materialized slices (default: ``device``; :func:`~zerorun.zero.deferred.place_on`)."""

    log: list[tuple[Any, tuple, dict, Any]]
    rng: dict[str, torch.Tensor]
    device: torch.device
    place: torch.device


def key(t: torch.Tensor) -> int:
    """Identity of ``t``'s storage (shared by its views)."""
    return t.untyped_storage()._cdata


def rng_states(device: torch.device) -> dict[str, torch.Tensor]:
    """The generator states construction on ``device`` draws from (CPU, and that GPU's when it is one)."""
    states = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    return states


def set_rng_states(states: dict[str, torch.Tensor], device: torch.device) -> None:
    """Restore states from :func:`rng_states`."""
    torch.set_rng_state(states["cpu"])
    if "cuda" in states:
        torch.cuda.set_rng_state(states["cuda"], device)


class _MetaFactories(TorchFunctionMode):
    """Tensor factories without a ``device`` go to the meta device; data factories stay real (Note [What the
    recording sees])."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _META_FACTORIES and kwargs.get("device") is None:
            kwargs["device"] = torch.device("meta")
        elif func is torch.Tensor.new_tensor and args and _meta(args[0]) and \
                torch.device(kwargs.get("device") or "meta").type == "meta":
            # the data is real; its meta image is made by a logged copy, which the replay repeats
            dtype = kwargs.get("dtype") or args[0].dtype
            real = torch.tensor(*args[1:], dtype=dtype, requires_grad=kwargs.get("requires_grad", False))
            return real.to("meta")
        elif getattr(func, "__self__", None) is _DATA_DESCRIPTOR and func.__name__ == "__set__" and \
                _meta(args[0]) and isinstance(args[1], torch.Tensor) and not _meta(args[1]):
            return func(args[0], args[1].to("meta"))  # ``p.data = real``: a logged copy the replay repeats
        elif func in _DATA_FACTORIES and isinstance(kwargs.get("device"), (str, torch.device)) and \
                torch.device(kwargs["device"]).type == "meta":
            real = func(*args, **dict(kwargs, device="cpu"))
            return real.to("meta")
        return func(*args, **kwargs)


def _meta(x: Any) -> bool:
    """``x.is_meta`` without the property construction code sees (which says ``False`` while recording)."""
    return isinstance(x, torch.Tensor) and x.device.type == "meta"


def _snapshot(x):
    """A real tensor read by a recorded op, as it is at that moment (later in-place changes do not leak)."""
    return x.detach().clone() if isinstance(x, torch.Tensor) and not _meta(x) else x


def _alias(x):
    """A new tensor object on a meta tensor's storage: the log must not follow the user's object if its
    storage is swapped later (``p.data = ...``)."""
    return x.detach() if _meta(x) else x


def _image(x):
    """A real tensor's meta image, so the op runs on meta (a 0-dim real tensor mixes with meta as it is)."""
    return x.to("meta") if isinstance(x, torch.Tensor) and not _meta(x) and x.dim() > 0 else x


class _Recorder(TorchDispatchMode):
    """Logs every aten op on a meta tensor (Note [What the recording sees]); keeps real shadows of small
    values that need no random numbers (Note [Shadow values])."""

    SHADOW_NUMEL = 1 << 16  # the largest storage (elements) given a shadow

    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple[Any, tuple, dict, Any]] = []
        self.rng: dict[str, torch.Tensor] | None = None
        self.device = torch.get_default_device()
        self.created: set[int] = set()  # storages made by a logged op
        self.shadow: dict[int, torch.UntypedStorage] = {}  # Note [Shadow values]

    def _on_shadows(self, func, args, kwargs):
        """``func`` run on the real shadows of its meta inputs (``None`` when one has none, or the op draws
        random numbers, or it fails on them)."""
        if torch.Tag.nondeterministic_seeded in func.tags:
            return None
        if any(_meta(t) and key(t) not in self.shadow for t in tree_flatten((args, kwargs))[0]):
            return None

        def real(x):
            if _meta(x):
                return torch.empty(0, dtype=x.dtype).set_(self.shadow[key(x)], x.storage_offset(), x.size(),
                                                          x.stride())
            return torch.device("cpu") if isinstance(x, torch.device) and x.type == "meta" else x

        try:
            return func(*tree_map(real, args), **tree_map(real, kwargs))
        except Exception:  # noqa: BLE001 - no shadow then
            return None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        meta_in = any(_meta(t) for t in tree_flatten((args, kwargs))[0])
        written = []
        for i, a in enumerate(func._schema.arguments):
            if a.alias_info is not None and a.alias_info.is_write:
                target = args[i] if i < len(args) else kwargs.get(a.name)
                if isinstance(target, torch.Tensor):
                    written.append(target)
        if meta_in and any(not _meta(t) for t in written):
            raise Unrecordable(f"{func} writes meta (deferred) data into a real tensor")
        if self.rng is None and meta_in:  # after any torch.manual_seed the factory itself calls first
            self.rng = rng_states(self.device)
        rng = rng_states(self.device) if self.rng is None else None
        try:
            out = func(*tree_map(_image, args), **tree_map(_image, kwargs)) if meta_in else func(*args, **kwargs)
            shadow = self._on_shadows(func, args, kwargs) if all(
                t.untyped_storage().nbytes() <= self.SHADOW_NUMEL * t.element_size()
                for t in tree_flatten(out)[0] if _meta(t)) else None
        except Exception:  # needs values (.item(), a data-dependent shape): from the shadows, if there are
            shadow = self._on_shadows(func, args, kwargs) if meta_in and not written else None
            if shadow is None:
                raise
            out = tree_map(lambda r: r.to("meta") if isinstance(r, torch.Tensor) else r, shadow)
        meta_out = [t for t in tree_flatten(out)[0] if _meta(t)]
        if shadow is None:
            for t in written + meta_out:
                self.shadow.pop(key(t), None)
        else:  # written inputs: their shadows were updated in place
            for m, r in zip(tree_flatten(out)[0], tree_flatten(shadow)[0]):
                if _meta(m) and isinstance(r, torch.Tensor):
                    self.shadow[key(m)] = r.untyped_storage()
        if meta_in or meta_out:
            if self.rng is None:
                self.rng = rng
            self.created.update(key(t) for t in meta_out)
            self.log.append((func, tree_map(_alias, tree_map(_snapshot, args)),
                             tree_map(_alias, tree_map(_snapshot, kwargs)), tree_map(_alias, out)))
        return out


def record(factory: Callable[..., Any], args: tuple, kwargs: dict) -> tuple[Any, Record]:
    """Run ``factory(*args, **kwargs)`` under the recording modes and verify the record (Note [What the
    recording sees]).

    Returns:
        ``(model, record)``: the model holds meta tensors (and real ones made from data).

    Raises:
        Unrecordable: the record is not complete (the message names the first tensor or op); any exception of
            the factory itself under recording is raised as is.
    """
    recorder = _Recorder()
    # construction code that skips meta tensors (torch.nn.init.trunc_normal_, orthogonal_, sparse_, ...) must
    # not see them: ``Tensor.is_meta`` says False while recording (the recording itself uses the device)
    patch = "is_meta" not in torch.Tensor.__dict__  # not when nested in another recording
    if patch:
        torch.Tensor.is_meta = property(lambda self: False)  # type: ignore[assignment,method-assign]
    try:
        with _MetaFactories(), recorder:
            model = factory(*args, **kwargs)
    finally:
        if patch:
            del torch.Tensor.is_meta
    rng = recorder.rng if recorder.rng is not None else rng_states(recorder.device)
    if any(not torch.equal(rng_states(recorder.device)[k], v) for k, v in rng.items()):
        raise Unrecordable("the model factory drew random numbers on real (non-meta) tensors")
    if isinstance(model, nn.Module):
        check_complete(model, recorder.created)
    return model, Record(recorder.log, rng, recorder.device, recorder.device)


def check_complete(model: nn.Module, created: set[int]) -> None:
    """Every meta parameter and buffer of ``model`` was created by a logged op.

    Raises:
        Unrecordable: naming the first tensor whose data came in by a path the recording did not see.
    """
    for name, t in list(model.named_parameters(remove_duplicate=False)) + \
            list(model.named_buffers(remove_duplicate=False)):
        if t is not None and t.is_meta and key(t) not in created:
            raise Unrecordable(f"{name!r} got its values by an operation the meta-device recording cannot see")
    # a hook that holds a tensor made during construction (a gradient mask) would run on a meta tensor: the
    # replay gives parameters their values, not the tensors a hook keeps in its closure
    for name, p in model.named_parameters(remove_duplicate=False):
        for hook, _ in parameter_hooks(p):
            if holds_meta_tensor(hook):
                raise Unrecordable(f"a gradient hook on {name!r} holds a tensor made during construction")
    for name, m in model.named_modules():
        for table in (m._forward_pre_hooks, m._forward_hooks, m._backward_pre_hooks, m._backward_hooks):
            if any(holds_meta_tensor(h) for h in table.values()):
                raise Unrecordable(f"a hook on module {name or 'the model'!r} holds a tensor made during "
                                   "construction")


def parameter_hooks(p: torch.Tensor) -> list[tuple[Callable, str]]:
    """The gradient hooks registered on ``p``, each with the name of the method that registers such a hook
    (``register_hook``, ``register_post_accumulate_grad_hook``)."""
    return [(h, register) for table, register in _GRAD_HOOKS.items() for h in (getattr(p, table, None) or {}).values()]


def holds_meta_tensor(fn: Callable) -> bool:
    """Whether ``fn`` (a hook) keeps a meta tensor in its closure, its defaults or its bound object's
    attributes (``functools.partial`` arguments too)."""
    held: list[Any] = [c.cell_contents for c in (getattr(fn, "__closure__", None) or ()) if _filled(c)]
    held += list(getattr(fn, "__defaults__", None) or ())
    held += list(getattr(fn, "args", ()) or ()) + list((getattr(fn, "keywords", None) or {}).values())
    owner = getattr(fn, "__self__", None)
    if owner is not None and not isinstance(owner, (nn.Module, torch.Tensor)):
        held += list(getattr(owner, "__dict__", {}).values())
    return any(isinstance(t, torch.Tensor) and t.is_meta for t in tree_flatten(held)[0])


def _filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True
