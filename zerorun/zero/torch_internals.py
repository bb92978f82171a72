"""The only place zero/ touches private torch APIs; ``tests/test_reducer.py`` fails when torch changes them.

- :func:`in_backward`: whether autograd's engine is running on this thread (stage 3 must not free a unit
  whose forward runs again inside backward: activation checkpointing's recomputation).
- :func:`will_accumulate`: whether the running backward will still accumulate a gradient into a leaf
  (stage 3 decides at the end of a unit's backward whether a bucket waits for more gradients).
- :func:`sole_owner`: whether a tensor is the only one on its storage (the reducer adopts such a gradient:
  Note [Adopted gradient] in ``adoption.py``).
- :func:`keep_for_process`: an object that outlives the interpreter's shutdown (CPython's ``Py_IncRef``: the
  handles of the last collectives, Note [Last reference on the issuing thread] in ``held.py``).
- :func:`group_timeout`: a process group's collective timeout (stage 3's control group, made beside an NCCL group,
  waits as long as that group: ``launch.collective_timeout_s``, not torch's 30-minute default).
- :func:`run_last`: a gradient hook moved behind the ones registered after it (the reducer's: Note [User gradient
  hooks run first] in ``user_model.py``).
- :func:`coalesced`: several collectives of one kind issued as one (``torch.distributed._coalescing_manager``:
  one NCCL group launch; used under NCCL only, Note [One all-gather per unit] in ``units.py``).
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
from typing import Callable

import torch
import torch.distributed as dist


def in_backward() -> bool:
    """True while autograd's engine executes a backward on this thread (``torch._C._current_graph_task_id``)."""
    return torch._C._current_graph_task_id() != -1


def will_accumulate(p: torch.Tensor) -> bool:
    """Inside a backward: whether the running graph task will execute ``p``'s gradient accumulator (``p`` a
    leaf that requires grad) (``torch._C._will_engine_execute_node``). Must be called inside backward."""
    return bool(torch._C._will_engine_execute_node(torch.autograd.graph.get_gradient_edge(p).node))


def run_last(p: torch.Tensor, handle) -> None:
    """Move the post-accumulate-grad hook of ``handle`` (from ``p.register_post_accumulate_grad_hook``) behind
    every other one on ``p``: torch runs them in the order of the dict ``p._post_accumulate_grad_hooks``, read
    at each call with ``PyDict_Next``, which sees the order of insertion (not ``OrderedDict.move_to_end``'s):
    the hook is taken out and put in again."""
    hooks = p._post_accumulate_grad_hooks
    if hooks and next(reversed(hooks)) != handle.id:
        hooks[handle.id] = hooks.pop(handle.id)


def sole_owner(t: torch.Tensor) -> bool:
    """Whether ``t`` is the only tensor on its storage: no view of it, no other tensor on the same storage,
    nothing autograd saved or will still pass on that shares it (``torch._C._storage_Use_Count``, which counts
    the tensors and storage objects holding the storage)."""
    storage = t.untyped_storage()  # held here, so counted: t's and this one's
    return torch._C._storage_Use_Count(storage._cdata) <= 2


def group_timeout(group: dist.ProcessGroup | None) -> datetime.timedelta | None:
    """How long ``group``'s collectives wait (its device backend's ``options._timeout``), or None where torch
    does not say."""
    group = group if group is not None else dist.group.WORLD
    for device in ("cuda", "cpu"):
        try:
            return group._get_backend(torch.device(device)).options._timeout
        except (RuntimeError, AttributeError, ValueError):
            continue
    return None


def coalesced(group: dist.ProcessGroup | None, issue: Callable[[], None]):
    """Run ``issue()``, which issues collectives of one kind on ``group`` (all-gathers, say), as one coalesced
    collective (``torch.distributed._coalescing_manager(group, async_ops=True)``: under NCCL one group launch;
    not under gloo, whose coalesced all-gather corrupts the heap: Note [One all-gather per unit]), and return
    its handle (``.wait()``; on a GPU the current stream waits)."""
    with dist.distributed_c10d._coalescing_manager(group, async_ops=True) as manager:
        issue()
    return manager


def keep_for_process(obj: object) -> None:
    """Give ``obj`` one reference that is never dropped (``ctypes.pythonapi.Py_IncRef``): it and what it holds
    live until the process ends, through the interpreter's shutdown."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))
