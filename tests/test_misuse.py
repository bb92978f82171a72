"""Engine misuse (a backward too many, a step too early) raises on every rank before any collective, and the
same processes then train on to DDP's numbers."""

import pytest

import misuse_cases as cases

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("stage,units", [(0, ()), (1, ()), (2, ()), (3, ()), (3, ("Linear",))])
@pytest.mark.parametrize("kind,message", [
    ("double_backward", "2 backward calls without engine.step(); grad_accum_steps is 1: call engine.step() first "
                        "(the engine is unchanged; engine.optimizer.step() does not step it)"),
    ("early_step", "step() after 2 backward calls; grad_accum_steps is 4: run the remaining micro-steps first "
                   "(the engine is unchanged)"),
])
def test_misuse_raises_before_any_collective_and_training_goes_on(ranks, stage, units, kind, message):
    for rank, r in enumerate(ranks(2).run(cases.misuse, stage=stage, kind=kind, units=units)):
        (error, issued), = r["errors"]
        assert error.startswith(message) and issued == 0, f"rank {rank}: {r}"
        assert r["rel"] <= 1e-5, f"rank {rank}: {r}"


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("first_stage,close", [(3, False), (1, False), (0, True)])
def test_a_model_held_by_an_engine_is_refused_by_a_second_one(ranks, stage, first_stage, close):
    """Its parameters are partitioned into the first engine (stage 3), or carry its gradient hooks (stages 0-2),
    for as long as the model lives, closed or not: a second engine over it is one clear error on every rank,
    before any collective, and the first trains on. (Stages 0-2: the second engine was accepted and its first
    backward said "a gradient from a backward outside engine.backward", though the user called it.)"""
    for rank, r in enumerate(ranks(2).run(cases.second_engine, stage=stage, first_stage=first_stage, close=close)):
        error, issued = r["error"]
        assert error.startswith(f"this model is held by a stage {first_stage} engine already (parameter ") and \
            issued == 0, r
        assert "build a fresh model" in error and r["norm"] > 0, f"rank {rank}: {r}"


def test_a_model_on_the_meta_device_outside_deferred_init_is_one_line(ranks):
    for stage in range(4):
        for rank, (error, issued) in enumerate(ranks(2).run(cases.meta_model, stage=stage)):
            assert error.startswith("parameter 'a.weight' is on the meta device and has no values: build the model "
                                    "with zerorun.zero.deferred_init(factory, ...)") and issued == 0, (stage, error)


@pytest.mark.parametrize("stage,units", [(0, ()), (1, ()), (2, ()), (3, ()), (3, ("Linear",))])
@pytest.mark.parametrize("how", ["tensor", "autograd", "into_a_parameter", "before_step"])
def test_a_backward_outside_engine_backward_is_refused_naming_the_parameter(ranks, stage, units, how):
    """Note [One backward per micro-step]: an auxiliary loss's ``.backward(retain_graph=True)`` before
    ``engine.backward`` trained silently on this rank's gradient at stages 0-1 and raised a bare KeyError at
    stages 2-3; now every rank raises one line naming the parameter, before any collective (at stage 3 before the
    first all-gather, so that a rank running it alone does not wait for the others; ``inputs=[a parameter]`` was
    refused there as a read at rest). ``torch.autograd.grad`` on the input still works."""
    names = {n for n, _ in cases.Net().named_parameters()}
    results = ranks(2).run(cases.backward_outside, stage=stage, units=units, how=how)
    for rank, ((error, issued), grad_error) in enumerate(results):
        assert error.startswith("parameter '") and error.split("'")[1] in names, f"rank {rank}: {error}"
        assert "got a gradient from a backward outside engine.backward" in error and "\n" not in error, error
        assert issued == 0 and grad_error[0] == "no error", f"rank {rank}: {issued} {grad_error}"
    assert results[0][0] == results[1][0]


@pytest.mark.parametrize("stage", [1, 3])
def test_a_closed_engine_refuses_forward_backward_and_step(ranks, stage, tmp_path):
    """After ``engine.close()`` (its swap file and reader thread released) forward and backward ran on and a
    step failed inside a thread pool ("cannot schedule new futures after shutdown"); now each is one line on
    every rank, before any collective."""
    for rank, r in enumerate(ranks(2).run(cases.closed_engine, stage=stage, tmp=str(tmp_path))):
        assert all(e.startswith("this engine was closed (engine.close())") and n == 0 for e, n in r), (rank, r)


def test_a_loss_that_is_not_a_scalar_is_named_with_its_shape(ranks):
    for error, issued in ranks(2).run(cases.loss_not_scalar, stage=3):
        assert error == ("backward needs a scalar loss tensor, got Tensor of shape (4,) (reduce it: loss.mean() or "
                         "loss.sum())") and issued == 0, error


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_a_gradient_hook_that_returns_a_value_gets_torchs_message(ranks, stage):
    """Note [User gradient hooks run first]: torch passes a post-accumulate hook's return value on to the next hook
    (the reducer's, now last) and then refuses it; at stages 2-3 the reducer's hook raised a KeyError printing the
    whole gradient first."""
    for error in ranks(2).run(cases.hook_returns_a_value, stage=stage):
        assert error == "Tensor post accumulate grad hooks should return None.", error


@pytest.mark.parametrize("stage,accum,fail_step,fail_micro,how", [
    (0, 1, 1, 0, "function"), (1, 3, 1, 1, "function"), (2, 3, 2, 2, "function"), (3, 1, 0, 0, "function"),
    (3, 2, 1, 1, "function"), (2, 1, 1, 0, "outside"), (0, 2, 0, 1, "outside")])
def test_after_a_backward_that_raised_zero_grad_drops_the_step_and_training_goes_on(
        ranks, stage, accum, fail_step, fail_micro, how):
    """Note [A backward that raised]: a backward raising midway on every rank left partial gradients: stages 0-1
    trained silently on them summed with the next step's, stages 2-3 failed inside the reducer (a bare KeyError).
    Now backward and step are refused in one line naming the error, before any collective, until
    ``engine.zero_grad()``; then training equals plain PyTorch that skipped the batch, in the first step (stage 3
    learning its schedule) or later, at any micro-step; ``zero_grad()`` with nothing to drop changes nothing."""
    for rank, r in enumerate(ranks(2).run(cases.backward_that_raised, stage=stage, accum=accum, fail_step=fail_step,
                                          fail_micro=fail_micro, how=how)):
        raised, *refused = r["errors"]
        assert raised == "a check in backward failed" if how == "function" else "outside engine.backward" in raised
        for error, issued in refused:
            assert error.startswith(f"a backward raised ({'ValueError: a check' if how == 'function' else 'Runt'}")
            assert "engine.zero_grad() on every rank" in error and "\n" not in error and issued == 0, (rank, error)
        assert r["rel"] <= 1e-5, f"rank {rank}: {r}"


@pytest.mark.parametrize("stage", [0, 1])
def test_zero_grad_on_some_ranks_only_is_an_error_on_every_rank(ranks, stage):
    """Note [A backward that raised]: gradients dropped on one rank alone (a step skipped where one rank saw a NaN
    loss) would train on gradients that differ by rank, silently; now every rank raises at the end of the step's
    last backward, the step is refused, and after ``zero_grad()`` on every rank training goes on right. (At stages
    2-3 the micro-step run again on one rank reduce-scatters there alone: a wait until the collective timeout.)"""
    for rank, r in enumerate(ranks(2).run(cases.zero_grad_on_one_rank, stage=stage)):
        (mismatch, _), (refused, issued) = r["errors"]
        assert mismatch.startswith("engine.zero_grad() dropped this step's gradients on some ranks only"), r
        assert refused.startswith("a backward raised (RuntimeError: engine.zero_grad() dropped") and issued == 0, r
        assert r["rel"] <= 1e-5, f"rank {rank}: {r}"


@pytest.mark.parametrize("stage", [0, 2, 3])
@pytest.mark.parametrize("kind,message", [
    ("add_group", "engine.optimizer.add_param_group: the engine's optimizer steps this rank's fp32 master slices"),
    ("rank0_state", "engine.optimizer.load_state_dict: "),
    ("plain_state", "engine.optimizer.load_state_dict: the state was not saved by a zerorun engine's optimizer"),
])
def test_torch_optimizer_habits_on_engine_optimizer_are_refused_on_every_rank(ranks, stage, kind, message):
    """Note [The engine's optimizer] (found by review): a group added after initialize was stepped twice (stage 0)
    or ignored (stages 1-3), and rank 0's optimizer state loaded on every rank trained rank 1 with rank 0's
    moments (or, where the slices differ in size, failed on one rank while the others waited): each raises one
    line on every rank. At stage 0 rank 0's state is every rank's, and loads."""
    for rank, r in enumerate(ranks(2).run(cases.optimizer_habits, stage=stage, kind=kind)):
        if kind == "rank0_state" and stage == 0:  # every rank's state is the same whole one: loads, as under DDP
            assert r["error"] is None, f"rank {rank}: {r}"
            continue
        assert r["error"] is not None and r["error"].startswith(message) and "\n" not in r["error"], f"rank {rank}: {r}"
        if kind == "rank0_state":
            own = "another rank could not load its state" if rank == 0 else "saved by rank 0 of 2"
            assert own in r["error"], f"rank {rank}: {r}"


@pytest.mark.parametrize("stage", [0, 2])
def test_each_ranks_own_optimizer_state_loads_as_in_torch(ranks, stage):
    """Each rank loading the ``engine.optimizer.state_dict()`` it saved (with the model's values) goes on as the
    uninterrupted engine."""
    for rank, r in enumerate(ranks(2).run(cases.optimizer_habits, stage=stage, kind="own_state")):
        assert r["error"] is None and r["rel"] <= 1e-6, f"rank {rank}: {r}"
