"""A rank-side check that every tensor handed to a collective lives on the group's device.

Note [Checking devices on CPU]: on gloo every tensor is on the CPU, so "on the group's device" cannot be
seen from ``tensor.device``. :class:`DeviceCheck` stands in for a machine whose group device differs from the
default one (NCCL, CUDA): a ``TorchFunctionMode`` marks every tensor that zerorun's own code makes with a
constructor (``torch.tensor``, ``zeros``, ``empty``, ...) without ``device=`` (or with ``device=None``), where a
GPU run would get a CPU tensor, and every tensor computed from a marked one, except by in-place ops, ``out=``
and ``.to(device)`` / ``.cuda()``. Each tensor a :class:`Comm` collective receives must be unmarked and on
``comm.device`` (:func:`zerorun.zero.comm.group_device`); a violation raises ``AssertionError`` on that rank,
naming the collective and the ``file:line`` that made the tensor.
"""

from __future__ import annotations

import contextlib
import os
import sys

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

import zerorun
from zerorun.zero.comm import Comm

CONSTRUCTORS = frozenset({"tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn",
                          "randint", "eye", "linspace"})
_ZERORUN = os.path.dirname(os.path.abspath(zerorun.__file__)) + os.sep
_MARK = "_zerorun_made_on_host"


def _zerorun_site() -> str | None:
    """``file:line`` of the constructor's caller when that is zerorun's code (not torch's, called by zerorun)."""
    frame = sys._getframe(2)
    while frame is not None and (frame.f_code.co_filename == __file__
                                 or frame.f_code.co_filename.endswith(os.path.join("torch", "overrides.py"))):
        frame = frame.f_back
    path = os.path.abspath(frame.f_code.co_filename) if frame is not None else ""
    if path.startswith(_ZERORUN):
        return f"{os.path.relpath(path, os.path.dirname(_ZERORUN[:-1]))}:{frame.f_lineno}"
    return None


def _moves(name: str, args, kwargs) -> bool:
    return name == "cuda" or (name == "to" and (kwargs.get("device") is not None
                                                or any(isinstance(a, (torch.device, str)) for a in args[1:])))


class _Marks(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        site = None
        if name in CONSTRUCTORS and kwargs.get("device") is None:
            site = _zerorun_site()
        elif not (name.endswith("_") and not name.endswith("__")) and "out" not in kwargs \
                and not _moves(name, args, kwargs):
            site = next((getattr(t, _MARK) for t in tree_flatten((args, kwargs))[0]
                         if isinstance(t, torch.Tensor) and hasattr(t, _MARK)), None)
        if site is not None:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    setattr(t, _MARK, site)
        return out


def check(comm: Comm, op: str, tensors) -> None:
    """Raise ``AssertionError`` if a tensor of ``op`` is marked (Note [Checking devices on CPU]) or off
    ``comm.device``."""
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        made = getattr(t, _MARK, None)
        assert made is None, f"{op}: a tensor made without a device at {made} (on the CPU on a GPU)"
        assert t.device == comm.device, f"{op}: a tensor on {t.device}, the group's device is {comm.device}"


#: every method of :class:`Comm` that issues a collective (the ones these checks, and program_order_cases, wrap)
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "all_gather_coalesced", "broadcast")


@contextlib.contextmanager
def device_check():
    """While active, every :class:`Comm` collective checks its tensors' devices (Note [Checking devices on
    CPU])."""
    saved = {name: getattr(Comm, name) for name in COLLECTIVES}

    def wrap(name, method):
        def checked(self, *args, **kwargs):
            check(self, name, [t for a in list(args) + list(kwargs.values())
                               for t in (a if isinstance(a, (list, tuple)) else [a])])
            return method(self, *args, **kwargs)
        return checked

    for name, method in saved.items():
        setattr(Comm, name, wrap(name, method))
    try:
        with _Marks():
            yield
    finally:
        for name, method in saved.items():
            setattr(Comm, name, method)
