"""Stage 3's checks that every rank runs the same units, agreed on the host (no GPU stall).

Note [Same units on every rank]: stage 3 all-gathers a unit on every rank together, and collectives pair up in
the order they are issued. If ranks run different units in one step (an MoE layer whose rank 0 runs expert 0
while rank 1 runs expert 1, both the same shape), the all-gathers pair one rank's expert 0 with the other's
expert 1 and training is silently wrong. Each rank therefore keeps the indices of the units it all-gathered since
the last step (prefetches included) and folds them into a digest ``h`` (a polynomial hash modulo a prime below
2**16). At the end of the step's last backward the ranks sum ``[h, h*h]`` (int64) on the host, in the reducer's
agreement on late and unused gradients (:class:`GatherDigest`, the reducer's ``rider``: one agreement, not two;
Note [Agreements on the host] in ``comm.py``: a CPU tensor over a gloo group, no GPU stall). Every rank's ``h``
is the same exactly when ``N * sum(h*h) == sum(h) ** 2`` (their variance is zero), so every rank learns the
verdict from the same sums and raises together, before the optimizer step; the digest of the forward's
all-gathers is also agreed before backward, beside Note [Backward on some ranks]'s marks, so that backward's
reduce-scatters never pair different units (of different sizes: a gloo abort) either. Only then, on the error
path, the ranks exchange their unit lists to name the units. A forward without gradients (evaluation), which no
backward follows, agrees on the digest at its end (``GatherDigest.check_now``): one host agreement per evaluation
forward, none in training. All-gathers outside a forward (``gathered_parameters``, a state dict) are in the next
step's or evaluation's digest. A collision (two different sequences with one digest) has a chance of 1 in 65521
per step; a misrouted step that is not caught pairs the same-shaped units and is caught at the next step whose
routing differs. A unit whose forward runs on some ranks only is not seen before its all-gather, which waits for
partners that never come (a check before each all-gather would be a collective of its own): when the group's
collective timeout (``launch.collective_timeout_s``) ends the wait, each rank raises one line naming where it
waited and the units it all-gathered in the step so far (:func:`timed_out`), in place of gloo's own message.
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist

from zerorun.zero.comm import alike
from zerorun.zero.units import UnitState


_PRIME = 65521


def order_digest(indices: list[int]) -> int:
    """A digest in ``[0, 65521)`` of a sequence of unit indices (order and length matter)."""
    h = len(indices) % _PRIME
    for i in indices:
        h = (h * 257 + i + 1) % _PRIME
    return h


class GatherDigest:
    """Note [Same units on every rank]: the digest of the units ``engine`` all-gathered since the last check, as
    the reducer's ``rider`` (its values join the reducer's agreement at the end of the step's last backward).
    In the first step the outer units' records ride along too (Note [Outer units] in stage3_outer.py)."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def values(self) -> list[int]:
        outer = self.engine.sched.outer
        codes = outer.codes() if outer.learning else []
        return [x for v in [order_digest(self.engine.gathering.log), *codes] for x in (v, v * v)]

    def check_now(self) -> None:
        """After a forward without gradients (evaluation: no backward follows to carry the digest), the ranks
        agree on it now, on the host. Raises RuntimeError on every rank where they ran different units."""
        engine = self.engine
        if engine.world_size > 1:
            h = order_digest(engine.gathering.log)
            if not alike(engine.world_size, *engine.comm.agree([h, h * h])):
                _raise_mismatch(engine, engine.gathering.log)
        engine.gathering.log.clear()

    def take(self, sums: list[int]) -> None:
        """``sums``: :meth:`values` summed over the ranks. Raises RuntimeError on every rank where they differ."""
        n, outer = self.engine.world_size, self.engine.sched.outer
        if not alike(n, sums[0], sums[1]):
            _raise_mismatch(self.engine, self.engine.gathering.log)
        self.engine.gathering.log.clear()
        if outer.learning:
            outer.agree([alike(n, a, b) for a, b in zip(sums[2::2], sums[3::2])], sums[2::2])


def _raise_mismatch(engine, indices: list[int]) -> None:
    names = [u.name or "<root>" for u in engine.units]
    every: list = [None] * engine.world_size
    dist.all_gather_object(every, indices, group=engine.comm.control)
    k = next((k for k in range(max(map(len, every))) if len({tuple(seq[k:k + 1]) for seq in every}) > 1), 0)
    which = ", ".join(f"rank {engine.comm.global_rank(r)}: {names[seq[k]] if k < len(seq) else 'nothing'!r}"
                      for r, seq in enumerate(every))
    raise RuntimeError(
        f"stage 3: ranks ran different units in one step (all-gather #{k + 1} of the step: {which}); "
        "all-gathers pair up across ranks, so every rank must run the same units in the same order. Run every "
        "unit on every rank (an MoE expert that gets no tokens on a rank still runs, on an empty batch), or "
        "make the module that chooses between them one unit (zero.units), or use stage 2")


#: How gloo (tcp/unbound_buffer.cc, tcp/pair.cc) and NCCL (ProcessGroupNCCL.cpp) word a collective that timed out;
#: a user's own error that mentions a timeout is not one (it passes through unchanged).
_COLLECTIVE_TIMEOUT = re.compile(r"Timed out waiting \d+ms for (send|recv) operation|Socket Timeout|"
                                 r"timeout caused pair closure|collective operation timeout")
#: How gloo (tcp/pair.cc) and NCCL word a peer that left while this rank waited: the rank that timed out first
#: closes its connections, so the others see this, not a timeout of their own.
_PEER_CLOSED = re.compile(r"\[[^\]]*pair\.cc:\d+\] (Connection closed by peer|Read error .*Connection reset by peer|"
                          r"Socket closed)|ncclRemoteError|remote process exited")


def _how(error: BaseException) -> str | None:
    """How a collective ended for ``error``: ``"timed out"``, ``"lost a peer (it timed out or failed)"``, or None
    (not gloo's or NCCL's wording of either)."""
    if isinstance(error, RuntimeError) and _COLLECTIVE_TIMEOUT.search(str(error)):
        return "timed out"
    if isinstance(error, RuntimeError) and _PEER_CLOSED.search(str(error)):
        return "lost a peer (it timed out or failed)"
    return None


def timed_out(engine, error: BaseException, where: str) -> RuntimeError | None:
    """Note [Same units on every rank]: a stage-3 collective that timed out (``launch.collective_timeout_s``) in
    ``where`` ("forward", "backward", "the agreement before backward") is most often ranks that ran different units
    (a unit whose forward ran on some ranks only leaves the others out of its all-gather, which no check before it
    can see without a collective of its own). The error to raise instead of gloo's or NCCL's, which name nothing:
    the collective, and the units this rank all-gathered in the step so far, in order, to compare across ranks.
    The rank that times out first closes its connections, so its peers see a closed connection rather than a
    timeout of their own (which one is first is a race): a closed connection gets the same line, saying so,
    and stays a peer failure (Note [Blame] in launch/blame.py). None when ``error`` is neither."""
    how = _how(error)
    if how is None:
        return None
    names = [u.name or "<root>" for u in engine.units]
    waiting = [repr(u.name or "<root>") for u in engine.units if u.state is UnitState.GATHERING]
    what = f", waiting for the all-gather of {', '.join(waiting)}" if waiting else ""
    if how == "timed out":
        what += ": the other ranks did not issue it" if waiting else ": the other ranks did not reach it"
    return RuntimeError(
        f"stage 3: rank {engine.comm.global_rank(engine.rank)} {how} in {where}{what}. "
        "The units this rank all-gathered in this step, in order: "
        f"{', '.join(repr(names[i]) for i in engine.gathering.log) or 'none'}. Every rank must run the same units "
        "in the same order (compare this line across ranks): a unit whose forward runs on some ranks only leaves "
        "the others out of its all-gather. Run every unit on every rank, make the module that chooses between "
        "them one unit (zero.units), or use stage 2")


def called_on_some_ranks(engine, error: BaseException, call: str) -> RuntimeError | None:
    """The error to raise instead of gloo's or NCCL's when ``call`` (``"full_state_dict()"``), a collective that
    all-gathers every unit, timed out or lost its peer: most often it ran on some ranks only (``if rank == 0:
    torch.save(engine.state_dict())``, which is local at stages 0-2); None when ``error`` is neither."""
    if _how(error) is None:
        return None
    return RuntimeError(
        f"stage 3: rank {engine.comm.global_rank(engine.rank)} timed out in {call} or lost its peer there: it "
        "all-gathers every unit, so every rank must call it (sd = engine.full_state_dict() on every rank, then "
        "save sd on rank 0, where it holds the whole state dict)")


def check_no_writes(unit, own: bool = True) -> None:
    """Note [Writes inside a unit's forward]: at stage 3 a unit's parameters are a gathered copy from its
    all-gather until the unit is freed after its forward; an in-place write to one of them there (a clamp or
    max-norm constraint under ``torch.no_grad()``) would change only that copy and be lost when it is freed,
    so the step would train from other values than stage 0's. It is noticed by the parameters' version
    counters, read when the unit was gathered and again at the end of its forward (no collective), and at the end
    of the model's forward for every unit still gathered then (``own`` False: the root's forward, or another
    unit's, wrote a unit that had run, kept or read as an external).

    Raises:
        RuntimeError: naming the first parameter written and the ways out.
    """
    before = getattr(unit, "versions", None)
    if before is None:
        return
    now = unit.param_versions()
    names = [n for buf in unit.buffers for n in buf.names]
    for name, a, b in zip(names, before, now):
        if a != b:
            what = repr(unit.name or "<root>")
            where = (f"the forward of its unit {what}" if own else
                     "the model's forward or since the last step, outside engine.gathered_parameters (a persistent "
                     "parameter, zero.persistence_threshold: gathered always)" if unit.persistent else
                     f"the model's forward while its unit {what} was gathered")
            raise RuntimeError(
                f"stage 3: parameter {name!r} was written in place inside {where} (e.g. a "
                "clamp or max-norm constraint): at stage 3 the unit holds a gathered copy only while it is in use, so "
                "the write would be lost. Apply it outside the forward, inside engine.gathered_parameters([...], "
                "modifier_rank=0), or use stage 0-2")


# Note [Backward on some ranks]: a unit's backward all-gathers its parameters (and reduce-scatters its
# gradient) on every rank together. If its output reaches the loss on some ranks only (a branch taken on some
# ranks, an auxiliary head whose loss one rank skips), only those ranks would start that all-gather and the
# job would hang, or pair it with another collective (gloo aborts on the size mismatch, or, same size, a
# silently wrong result). Before backward, each rank walks the autograd graph from the loss and marks the
# units whose outputs (the grad_fn nodes recorded by the unit's forward hook) it reaches; the marks are summed
# over ranks in one agreement on the host, and a unit marked on some ranks but not all raises on every rank,
# naming it, before any collective of backward. (Running its backward with zero gradients on the other ranks
# would not do: where autograd schedules it among the other units can differ between ranks.) The walk visits
# each node once (its cost: benchmarks/results/history.md, issue 38). Outputs are recorded since the root's last
# forward (a forward without backward keeps no graph alive). The same agreement settles the units whose end of
# backward every rank reaches (Note [Program order] in reducer.py). A unit whose forward itself runs on some ranks
# only is not caught here: its forward all-gather already waits for the others (Note [Same units on every
# rank]; the launcher names the hung rank).
def check_backward_units(engine, loss: torch.Tensor) -> None:
    """Raise before backward if a unit's output reaches ``loss`` on some ranks but not on all (Note
    [Backward on some ranks]); forget the outputs recorded since the last backward either way. Also marks the
    tail outer units whose outputs reach ``loss`` on every rank ``deferred`` (Note [Outer units]): gathered in
    this backward when their gradient comes, not at its start (no error for the others: with the root).

    Raises:
        RuntimeError: on every rank, naming the units and how many ranks reach them.
    """
    listed = [u for u in engine.units if not u.is_root and not u.outer]
    tails = engine.sched.outer.tails()  # Note [Outer units]: deferred where every rank reaches them
    units = listed + tails
    recorded = [u.out_nodes for u in units]
    unsafe = engine.sched.outer.read_unrecorded  # Note [Outer units]: read without autograd recording: not deferred
    # Note [Program order] in reducer.py: the units' ends of backward (none for an ``open_ended`` unit: Note [End of a
    # unit's backward] in stage3_schedule.py, open-ended on every rank where it is on one)
    ends = [[] if u.open_ended else u.in_nodes for u in listed]
    for u in engine.units:
        u.out_nodes, u.in_nodes = [], []
        u.deferred = u.ends_agreed = False
    if not tails and (engine.world_size == 1 or not listed):
        for u, nodes in zip(listed, ends):
            u.ends_agreed = bool(nodes)
        return
    found = _reached(loss, {node for nodes in recorded + ends for node in nodes})
    reached = [bool(nodes) and all(n in found for n in nodes) for nodes in ends]
    # a call whose end the loss does not reach (inputs that need a gradient, unused) is never signalled either
    open_ended = [int(u.open_ended or (bool(nodes) and not r)) for u, nodes, r in zip(listed, ends, reached)]
    counts = ([int(any(n in found for n in nodes) and u not in unsafe) for u, nodes in zip(units, recorded)]
              + [int(r) for r in reached] + open_ended)
    n, h = engine.world_size, order_digest(engine.gathering.log)  # Note [Same units on every rank]: so far
    held = [u for u in listed if u.held]  # Note [Kept from forward to backward] in stage3_outer.py: the last unit
    counts += [len(held), h, h * h]
    if n > 1:  # Note [Agreements on the host] in comm.py: no device round trip
        counts = engine.comm.agree(counts)
    *counts, kept, hs, hsq = counts
    if kept != n * len(held):  # kept on some ranks only: gathered again in backward on every rank instead
        engine.sched.free(held)
    for u, m in zip(tails, counts[len(listed):]):
        u.deferred = m == n
    for u, m in zip(listed, counts[len(units):]):
        u.ends_agreed = m == n
    for u, m in zip(listed, counts[len(units) + len(listed):]):
        u.open_ended = m > 0
    partial = [(u, m) for u, m in zip(listed, counts) if 0 < m < n]
    if partial:
        which = "; ".join(f"unit {u.name!r} on {m} of {n} ranks" for u, m in partial[:3])
        raise RuntimeError(
            f"stage 3: a unit's output reaches the loss on some ranks only ({which}"
            f"{'; and more' if len(partial) > 3 else ''}): its backward would all-gather its parameters on those "
            "ranks alone (a hang). "
            "Make it reach the loss on every rank (e.g. loss = loss + 0.0 * out.sum() where it is not used), "
            "keep it inside a unit that every rank uses (zero.units: the class of a module every rank runs, such as "
            "the MoE layer holding the experts; automatic units take the modules of a ModuleList, ModuleDict or "
            "nn.Sequential), or use stage 2")
    if not alike(n, hs, hsq):  # before backward's reduce-scatters, which would pair different units too
        _raise_mismatch(engine, engine.gathering.log)


def _reached(loss: torch.Tensor, wanted: set) -> set:
    """The autograd nodes of ``wanted`` that the graph of ``loss`` reaches (each node visited once)."""
    found: set = set()
    seen: set = set()
    stack = [loss.grad_fn] if loss.grad_fn is not None else []
    while stack and len(found) < len(wanted):
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node in wanted:
            found.add(node)
        stack.extend(nxt for nxt, _ in node.next_functions if nxt is not None and nxt not in seen)
    return found
