"""``torch.autograd.grad`` over the model outside ``engine.backward`` (Note [Backward outside engine.backward] in
zerorun/zero/stage3_schedule.py): adversarial examples and input-gradient penalties train at stage 3 as at stage 0
(fp32, 1e-5 relative), whatever the size of the root and outer units."""

import pytest

import foreign_cases as cases


def _rel(a, b) -> float:
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-12)) for k in b)


@pytest.mark.parametrize("pattern", ["fgsm", "penalty", "param_penalty", "inside_create_graph", "inside_detached"])
@pytest.mark.parametrize("keep,units,accum", [(0, ("Block",), 1), (None, ("Block",), 1), (0, (), 1),
                                              (0, ("Block",), 2)])
def test_autograd_grad_around_engine_backward_trains_as_stage_0(ranks, pattern, keep, units, accum):
    """At bf2f9b1 16 of these 20 cases failed: with outer units that do not fit zero.keep_root_bytes (0 here; any
    model with an LM head) the adversarial example's input gradient and a penalty computed between the forward and
    engine.backward raised "module 'inp' ... took a gradient before the first listed unit's backward began" (a
    gradient never taken), and a penalty inside the forward with create_graph=True raised torch's "storage of size
    0" in backward, at every keep_root_bytes; a penalty on parameters' gradients was refused as a read at rest
    (``torch.autograd.grad`` with parameters as inputs). After a ``torch.autograd.grad`` outside a forward, only the
    units a recorded graph still reads stay gathered (none for the adversarial example); after the step, none."""
    pool = ranks(2)
    ref = pool.run(cases.train, stage=0, pattern=pattern, accum=accum)
    got = pool.run(cases.train, stage=3, pattern=pattern, keep=keep, units=units, accum=accum)
    for rank, (r, g) in enumerate(zip(ref, got)):
        assert max(abs(a - b) / abs(a) for a, b in zip(r["losses"], g["losses"])) <= 1e-5, (rank, r, g)
        assert _rel(g["state"], r["state"]) <= 1e-5, rank
        assert all(not units for units in g["after_step"]), g["after_step"]
        if pattern == "fgsm":
            assert all(not units for units in g["after_grad"]), g["after_grad"]
        if pattern == "penalty":  # its recorded graph reads every unit's weights in engine.backward
            assert all(units == g["every"] for units in g["after_grad"]), (g["after_grad"], g["every"])


@pytest.mark.parametrize("pattern,keep", [("raises", 0), ("raises_then_retry", 0), ("raises_then_retry", None),
                                          ("inside_retry", 0)])
def test_a_backward_outside_engine_backward_that_raised_does_not_leave_the_engine_in_it(ranks, pattern, keep):
    """Note [Backward outside engine.backward]: ``torch.autograd.grad`` whose pass raised midway (a hook's check) in
    the first step never reached its end; the next ``engine.backward`` then ran as such a pass, and the outer
    units' first step learned nothing from it (at 5bb96d0 the head was not found a tail, so it was held through the
    loss's backward). Now the next ``engine.backward`` ends it first: the schedule is the one learned without it.
    The same call run again with a graph (a penalty trained through, after the forward or inside it) found the pass
    begun and pinned nothing: its graph then read the freed root and outer units in backward ("storage of size
    0"; inside the forward also before). Every case has stage 0's numbers, and nothing stays gathered after a
    step."""
    pool = ranks(2)
    ref = pool.run(cases.train, stage=0, pattern=pattern)
    clean = pool.run(cases.train, stage=3, pattern="", keep=keep)
    got = pool.run(cases.train, stage=3, pattern=pattern, keep=keep)
    for rank, (r, c, g) in enumerate(zip(ref, clean, got)):
        assert g["schedule"] == c["schedule"] and any(s or t for s, t in c["schedule"].values()), (rank, g, c)
        assert max(abs(a - b) / abs(a) for a, b in zip(r["losses"], g["losses"])) <= 1e-5, (rank, r, g)
        assert _rel(g["state"], r["state"]) <= 1e-5, rank
        assert g["after_step"] == [[]] * len(g["after_step"]), (rank, g["after_step"])
