"""The handles of a Comm's last collectives, kept so that the issuing thread drops the last reference to each.

Note [Last reference on the issuing thread]: an asynchronous collective's work holds the tensors it was given; a
gloo worker thread (NCCL: its watchdog) drops its own reference to the work a moment after marking it done, while
the waiting thread goes on. Where that drop is the last one, the worker frees the work and with it its references
to tensors made in Python, which takes the GIL; while the interpreter is shutting down it cannot, and the process
aborts (``terminate called without an active exception``; the core: the main thread in ``Py_FinalizeEx``, a gloo
worker in ``~AsyncAllgatherWork`` -> ``decref_pyobject`` -> ``take_gil``). It is torch's race, not zerorun's: a
plain torch script that does 50 all-reduces and exits without ``destroy_process_group`` aborts in about a third
of its exits. It hits a script that uses zerorun's engine directly and exits right after a step (zerorun's own
ranks end with ``os._exit``: Note [Exit without teardown] in launch/exiting.py): before this module, 1-18 of 40
such exits aborted, at every stage.

:class:`HeldWorks` keeps the handles of a Comm's last ``size`` collectives of every kind whose tensors outlive
them anyway (all-gathers into flat buffers, all-reduces of gradients or of a norm in place, broadcasts, the host
agreements' works): a handle is dropped by the issuing thread when ``size`` later ones have been issued, long
after the worker let go of it. At exit (``atexit``) the handles held by live Comms get a reference that is never
dropped (:func:`~zerorun.zero.torch_internals.keep_for_process`), so no worker frees them during the shutdown.
Not held: the reduce-scatters of gradients, whose handles hold their bucket (holding them kept stage 2's buckets
past their use: its backward peak rose from at most 7 to 11.7 buckets, ``tests/test_reducer.py``); a gradient
reduction is never a step's last collective (the norm's all-reduce or the parameters' all-gather follows it).
A dropped Comm's handles are not kept: that pinned the flat parameters of the last engines dropped in a sweep.
Synchronous collectives are issued as asynchronous ones and held too (:meth:`Comm.all_reduce_now`), so a
checkpoint saved just before exit is covered.
A script that calls ``destroy_process_group()`` before it ends joins gloo's workers there, unless something still
holds the default group: ``torch.distributed.nn.functional`` binds it as a default argument (``group=group.WORLD``,
evaluated when the module is imported), and torch imports that module (through ``torch._dynamo``) when the first
optimizer is built, after ``init_process_group`` in most scripts; the workers then lived on into the shutdown
(found by review: both ``pt_gloo_runloop`` threads alive after ``destroy_process_group()``; a plain torch script
of 50 all-reduces that imports it after ``init_process_group`` aborted in 12 of 15 exits). So this module, which
every engine imports, imports it first: where zerorun is imported before ``init_process_group`` its defaults are
``None`` (the default group, looked up when called) and ``destroy_process_group()`` joins the workers again.
"""

from __future__ import annotations

import atexit
import collections
import weakref

import torch.distributed as dist

from zerorun.zero.torch_internals import keep_for_process

if dist.is_available():  # before the user's init_process_group, where zerorun is imported first
    import torch.distributed.nn.functional  # noqa: F401

#: every HeldWorks alive (one per live Comm): at exit their handles are kept for the life of the process
_LIVE: weakref.WeakSet = weakref.WeakSet()


class HeldWorks:
    """The last ``size`` collective handles given to :meth:`hold` (Note [Last reference on the issuing thread])."""

    def __init__(self, size: int) -> None:
        self._works: collections.deque = collections.deque(maxlen=size)
        _LIVE.add(self)

    def hold(self, work):
        """Keep ``work``, a handle just issued, until ``size`` later ones are held; return it."""
        self._works.append(work)
        return work

    def __iter__(self):
        return iter(list(self._works))

    def keep_for_process(self) -> None:
        """Give the handles held now a reference never dropped: they live through the interpreter's shutdown."""
        keep_for_process(self._works)


@atexit.register
def _keep_held_handles() -> None:
    for held in list(_LIVE):
        held.keep_for_process()
