"""Counting host syncs on CPU: the reads of a tensor's value that stall a GPU pipeline.

On CUDA, ``.item()``, ``bool()``, ``int()``, ``float()``, ``.tolist()`` of a device tensor wait for every kernel
queued before it (``torch.cuda.set_sync_debug_mode`` reports them on a GPU). On CPU nothing stalls, but the
same calls pass through ``__torch_function__``, so a :class:`HostSyncCounter` (a ``TorchFunctionMode``) sees
each one. Only the calls made by zerorun's own code are counted: the first frame outside torch is in the
``zerorun`` package. Tests use it around steady micro-steps and optimizer steps to hold the device path's
bounds (0 per micro-step; at most 1 per optimizer step, fp16's overflow decision).
"""

from __future__ import annotations

import os
import sys
from collections import Counter

from torch.overrides import TorchFunctionMode

import zerorun

#: Tensor methods that read a value back to the host.
SYNC_READS = frozenset({"item", "__bool__", "__int__", "__float__", "__index__", "tolist", "numpy"})

_ZERORUN = os.path.dirname(os.path.abspath(zerorun.__file__)) + os.sep
_TORCH = os.path.dirname(os.path.dirname(os.path.abspath(__import__("torch").__file__))) + os.sep + "torch" + os.sep


def _caller() -> str | None:
    """``file:line`` of the first frame outside torch and this module, or None when it is not zerorun's."""
    frame = sys._getframe(2)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith(_TORCH) and path != os.path.abspath(__file__):
            if path.startswith(_ZERORUN):
                return f"{os.path.relpath(path, os.path.dirname(_ZERORUN[:-1]))}:{frame.f_lineno}"
            return None
        frame = frame.f_back
    return None


class HostSyncCounter(TorchFunctionMode):
    """Counts zerorun's reads of tensor values while active.

    Attributes:
        sites: ``Counter`` of ``"zerorun/zero/x.py:LINE"`` -> number of reads made there.
    """

    def __init__(self) -> None:
        super().__init__()
        self.sites: Counter[str] = Counter()

    @property
    def count(self) -> int:
        """Reads counted so far."""
        return sum(self.sites.values())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", None) in SYNC_READS:
            site = _caller()
            if site is not None:
                self.sites[site] += 1
        return func(*args, **(kwargs or {}))
