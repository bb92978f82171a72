"""What each ZeRO stage does, in one table (ZeRO paper §5, arXiv:1910.02054).

Note [Stage policies]: the engine is one mechanism (flat buffers, fp32 master slices, a gradient reducer); a
stage is a :class:`StagePolicy`, a frozen record of the choices in which stages differ. Reading ``POLICIES``
answers "what does stage S do" without reading the engine:

====================  =========  ===============  ===============  ================
                      stage 0    stage 1          stage 2          stage 3
====================  =========  ===============  ===============  ================
optimizer owns        all        its slice        its slice        its slice
full gradient kept    yes        yes              no (transient)   no (transient)
collective            all-reduce reduce-scatter   reduce-scatter   reduce-scatter
reduced when          last micro last micro-step  every micro-step every micro-step
reduces in flight     unbounded  MAX_INFLIGHT     MAX_INFLIGHT     MAX_INFLIGHT
reduced at            readiness  readiness        readiness        fixed points (Note [Program order])
``p.grad`` after bwd  reduced    ``None``         ``None``         ``None``
params after step     whole      all-gathered     all-gathered     slice only
====================  =========  ===============  ===============  ================

Stage 1's ``p.grad`` is ``None`` after the last micro-step's backward: each rank reduces only its own slice
(that is stage 1's saving in communication), so no rank has the full reduced gradient; a half-reduced tensor
would be silently wrong for anyone reading it. The gradients come back (zeroed) after :meth:`step`. The
global gradient norm is what :meth:`ZeroEngine.step` returns.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StagePolicy:
    """The choices one ZeRO stage makes (Note [Stage policies]).

    Attributes:
        stage: 0-3.
        partition_optimizer: the optimizer sees this rank's slice of each flat buffer (else the whole buffer).
        keep_full_grad: a full flat gradient per buffer lives across micro-steps, with ``p.grad`` views of it;
            otherwise a bucket's full gradient exists only until its reduce-scatter is done and a rank keeps
            its slice (``shard_grad``).
        all_reduce: the gradient collective is an all-reduce (stage 0) rather than a reduce-scatter.
        reduce_every_micro_step: reduce on every micro-step (else only on the last of a step).
        bound_in_flight: at most ``MAX_INFLIGHT`` reductions in flight (each holds a bucket-sized buffer).
        ordered_launch: reductions are launched only at the points the engine names (a listed unit's end of
            backward, the end of backward), never when a bucket becomes ready (Note [Program order] in
            ``reducer.py``).
        reduced_grad_visible: ``p.grad`` holds the full reduced gradient after the last backward of a step.
        gather_after_step: all-gather the updated slices into whole parameters after the optimizer step.
    """

    stage: int
    partition_optimizer: bool
    keep_full_grad: bool
    all_reduce: bool
    reduce_every_micro_step: bool
    bound_in_flight: bool
    reduced_grad_visible: bool
    gather_after_step: bool
    ordered_launch: bool = False


POLICIES = {
    0: StagePolicy(0, partition_optimizer=False, keep_full_grad=True, all_reduce=True, reduce_every_micro_step=False,
                   bound_in_flight=False, reduced_grad_visible=True, gather_after_step=False),
    1: StagePolicy(1, partition_optimizer=True, keep_full_grad=True, all_reduce=False, reduce_every_micro_step=False,
                   bound_in_flight=True, reduced_grad_visible=False, gather_after_step=True),
    2: StagePolicy(2, partition_optimizer=True, keep_full_grad=False, all_reduce=False, reduce_every_micro_step=True,
                   bound_in_flight=True, reduced_grad_visible=False, gather_after_step=True),
    3: StagePolicy(3, partition_optimizer=True, keep_full_grad=False, all_reduce=False, reduce_every_micro_step=True,
                   bound_in_flight=True, reduced_grad_visible=False, gather_after_step=False,
                   ordered_launch=True),
}
