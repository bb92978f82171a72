"""Stage 3's units (zerorun/zero/stage3.py, units.py): what the parameters are while a unit computes and at
rest, units named by module, what the run says of them, and units of different sizes."""

import re

import pytest
import torch.nn as nn

import gather_group_cases
import stage3_cases as cases
from distributed import RankPool
from zerorun.zero.unit_plan import pick_units

#: The two ways a rank's collective ends when the ranks ran different units: its own timeout, or the peer that
#: timed out first closing the connection (a race; Note [Same units on every rank]).
_HOW = r"(timed out|lost a peer \(it timed out or failed\))"


def assert_stage0_losses(pool, case, **kw) -> None:
    """``case(stage=3, **kw)`` trains to ``case(stage=0, **kw)``'s losses on every rank of ``pool`` (fp32, 1e-5;
    the case applies its stage-3 settings at stage 3 only)."""
    s0 = pool.run(case, stage=0, **kw)
    s3 = pool.run(case, stage=3, **kw)
    for rank, (a, b) in enumerate(zip(s3, s0)):
        assert a == pytest.approx(b, rel=1e-5), (case.__name__, kw, rank, a, b)

def test_parameters_are_plain_while_their_unit_is_gathered(ranks):
    """Note [Plain while gathered]: inside a unit's forward its parameters are ordinary ``nn.Parameter``s and no
    Python runs per torch operation on them (before: the guard's ``__torch_function__`` ran on every op); at
    rest they are guarded again, and a read between steps is refused naming the way out."""
    for r in ranks(2).run(cases.parameter_classes):
        assert r["inside"] == ["Parameter"], r
        assert r["guard_calls"] == 0, r  # inside the blocks, and in the engine's check before each forward
        assert r["rest"] == ["ZeroParameter"], r
        assert "gathered_parameters" in r["refused"], r


def test_a_unit_of_several_flat_buffers_is_gathered_in_one_collective(ranks):
    """Note [One all-gather per unit] in units.py: a unit holding one flat buffer per param group (AdamW with
    weight decay: matrices, and biases with norms) is all-gathered in one coalesced collective, not one per
    buffer (before: two per gather, each a round of latency and a wait), and its gradients reduce-scattered in
    one (Note [One reduce-scatter per launch] in gloo_reduce_scatter.py; before: one per buffer)."""
    for r in ranks(2).run(cases.collectives_per_gather):
        assert r["buffers"] == [2, 2, 2], r
        # 2 blocks twice; the root, the head and the last block once (small: kept gathered from forward into
        # backward, Note [Kept from forward to backward]; with zero.keep_root_bytes 0, all twice: 10 gathers in 7
        # collectives): 7 units gathered. Note [Units gathered together]: the root's, the head's and the first
        # block's at the start of the forward are one collective (before: one per unit)
        assert r["gathers"] == 7 and r["collectives"] == 5, r
        # Note [One reduce-scatter per launch]: the last two blocks' two buckets each at their end of backward as
        # one collective; the first block's (its input needs no gradient: no end of its own) and the head's, four
        # buckets, in one at the end of backward (before: one per bucket, 8)
        assert r["units_with_gradients"] == 4 and r["reduce_scatters"] == 3, r


def test_gathers_issued_together_are_grouped_alike_on_every_rank(ranks):
    """Note [Units gathered together]: a unit's all-gather and its prefetches go as one collective, so what a
    rank prefetches must not depend on anything but the units gathered. Before, a call of an already gathered
    unit on rank 0 alone (it gathers nothing) counted as leaving the recorded order there: from the next step rank
    1 prefetched three blocks in one message where rank 0 gathered one, and gloo aborted ("Received data size
    doesn't match expected size"). Now that call is not recorded, both ranks issue the same all-gathers, and the
    losses are stage 0's."""
    pool = ranks(2)
    s3 = pool.run(gather_group_cases.extra_call_on_one_rank, stage=3)
    s0 = pool.run(gather_group_cases.extra_call_on_one_rank, stage=0)
    assert s3[0]["gathers"] == s3[1]["gathers"] and len(s3[0]["gathers"]) > 20, s3
    for a, b in zip(s3, s0):
        assert a["losses"] == pytest.approx(b["losses"], rel=1e-5), (a, b)


def test_a_unit_called_twice_stays_gathered_until_both_calls_backward(ranks):
    """Note [Unit lifecycle]: a unit whose gradient buckets are complete is freed in backward only once every
    forward call's backward has reached it. Before, a unit called before and after the blocks whose first call
    read none of its parameters on rank 0 was freed there after the second call's backward and gathered again
    for the first call's, on rank 0 alone: the ranks' collectives parted and the job hung (a gloo abort before
    the units were gathered together). Now every rank trains to stage 0's losses."""
    assert_stage0_losses(ranks(2), gather_group_cases.first_call_idle_on_one_rank)


def test_a_second_backward_of_a_unit_on_some_ranks_changes_no_prefetch(ranks):
    """Note [Prefetch]: the backward order records a unit once per pass. Before, a unit called on the input and
    again after a block entered rank 0's backward order twice (its first call read its parameters there, only
    there): from the next step rank 0 prefetched it where rank 1 prefetched the unit after it, the two all-gathers
    queued together differed, and the job hung. Now both ranks record one order and train to stage 0's losses."""
    assert_stage0_losses(ranks(2), gather_group_cases.second_backward_on_one_rank)


def test_a_unit_called_on_the_input_stays_gathered_to_the_end_of_backward(ranks):
    """Note [End of a unit's backward]: a call whose inputs need no gradient signals no end of its backward, so
    its unit stays gathered to the end of backward. Before, such a unit, called again after a block, was freed
    once its gradient looked complete and gathered again for the first call's backward on some ranks alone, and
    the job hung: where its bucket, unused on rank 0 in the last step, counted as complete from the start; where
    the first call's output took a gradient through another unit's parameter on rank 1; and in the review's
    shared MoE layer, experts routed per rank (at 2 ranks the gathers paired other experts, at 4 a hang). Now
    each trains to stage 0's losses."""
    two, four = ranks(2), ranks(4)
    for prefetch_bytes in (None, 10**6):
        for pattern in ("unused-last-step", "other-units-parameter"):
            assert_stage0_losses(two, gather_group_cases.unit_called_on_the_input, pattern=pattern,
                                 prefetch_bytes=prefetch_bytes)
        for pool in (two, four):
            assert_stage0_losses(pool, gather_group_cases.shared_moe_routed_per_rank, prefetch_bytes=prefetch_bytes)
    # open-ended on every rank where it is on one: the input of s needs a gradient on rank 1 only, and s reads
    # another unit's weight (before: freed after its backward on rank 1, it let that unit go, gathered again there)
    assert_stage0_losses(two, gather_group_cases.input_needs_gradient_on_some_ranks)
    # and a call whose inputs the loss does not reach on some ranks: the mask token passed to s is unused on rank 0
    assert_stage0_losses(two, gather_group_cases.token_unused_on_some_ranks)


def test_ranks_that_leave_the_recorded_order_get_the_error_not_a_hang(ranks):
    """Note [Prefetch]: a pass that deviates from the recorded order prefetches no more. Before, rank 1 running
    its blocks in reverse from the second step on came back to the recorded order at the middle block and
    prefetched the last one again: one all-gather more than rank 0, which then paired with the agreement before
    backward, and the job hung instead of raising Note [Same units on every rank]'s error."""
    pool = ranks(2)
    timeout, pool.timeout = pool.timeout, 120
    try:
        for error in pool.run(cases.reordered_after_first_step):
            assert "ranks ran different units in one step" in error, error
    finally:
        pool.timeout = timeout


def test_an_evaluation_in_another_order_on_one_rank_is_an_error_on_every_rank(ranks):
    """Note [Same units on every rank]: a forward without gradients, which no backward follows, agrees on the
    units it gathered at its end. Before, an evaluation loop whose rank 1 ran the blocks in reverse (same shapes)
    paired one rank's blocks with the other's and returned wrong losses silently, forever."""
    results = ranks(2).run(cases.reordered_evaluation)
    for r in results:
        assert len(r["same"]) == 2 and r["same"][0] == r["same"][1], r
        assert "ranks ran different units in one step" in r["error"], r


def test_units_may_be_named_by_module_as_well_as_by_class():
    """``zero.units`` entries are module names (FSDP2's ``fully_shard(model.tok_embeddings)``) or class names."""
    model = nn.Sequential(nn.Embedding(4, 4), nn.Sequential(nn.Linear(4, 4), nn.ReLU()), nn.Linear(4, 2))
    assert [n for n, _ in pick_units(model, ("0", "Linear"))] == ["0", "1.0", "2"]
    assert [n for n, _ in pick_units(model, ("1",))] == ["1"]
    with pytest.raises(ValueError, match=r"no module of class Block in the model and no module of that name "
                                         r"\(its classes: .*Embedding.*; its top-level modules: 0, 1, 2\)"):
        pick_units(model, ("Block",))
    with pytest.raises(ValueError, match="names the whole model"):
        pick_units(model, ("",))


def test_units_that_would_never_be_gathered_are_refused_and_never_picked():
    """The model's own class is the root (before: "no module of class Net", while listing Net among its classes);
    a ModuleList is never called, so its hooks never run (before: taken as a unit whose parameters every block
    then read from outside it, a warning per parameter); the automatic choice looks inside one instead."""
    model = cases.Net(n=4)
    with pytest.raises(ValueError, match=r"^zero.units: 'Net' names the whole model, which is the root unit"):
        pick_units(model, ("Net",))
    for entry in ("blocks", "ModuleList"):
        with pytest.raises(ValueError, match=r"^zero.units: 'blocks' is a ModuleList, which is never called .* name "
                                             r"the class of the modules it holds \(Block\) instead"):
            pick_units(model, (entry,))
    lists = nn.Sequential(nn.ModuleList([nn.Linear(8, 8)]), nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8))
    assert [n for n, _ in pick_units(lists, ())] == ["0.0", "1", "2", "3"]


def test_automatic_units_are_taken_inside_containers_only(ranks):
    """A model whose forward skips a module on some ranks (a data-dependent head) hung or aborted at stage 3 with
    automatic units (a review): its attributes were picked as listed units, gathered on use. Now automatic units
    come from ModuleList/ModuleDict/Sequential only; such a model trains to stage 0's losses."""
    assert pick_units(cases.Branchy(), ()) == []
    assert [n for n, _ in pick_units(cases.Net(n=4), ())][:1] == ["blocks.0"]
    for got, want in zip(ranks(2).run(cases.branchy, stage=3), ranks(2).run(cases.branchy, stage=0)):
        assert got["losses"] == pytest.approx(want["losses"], rel=1e-5)
        # the run says why there is no unit, and how to have some (it said "none" alone: a review)
        assert got["lines"][0] == ("stage 3 units, gathered and freed one by one: none (automatic units come from "
                                   "a ModuleList, ModuleDict or nn.Sequential: the parameters below are gathered "
                                   "for each whole pass; name modules in zero.units to divide them)")


def test_a_named_head_is_a_unit_and_trains_as_stage_0(ranks):
    """The head named in ``zero.units`` is a unit of its own (not an outer unit picked automatically), the
    losses are stage 0's, and the run's description names every unit with its bytes."""
    named = ranks(2).run(cases.units_by_name, units=("Block", "head"))
    auto = ranks(2).run(cases.units_by_name, units=("Block",))
    ref = ranks(2).run(cases.units_by_name, units=(), stage=0)
    assert named[0]["roles"]["head"] == "listed" and auto[0]["roles"]["head"] == "outer"
    for got in (named, auto):
        for r, want in zip(got, ref):
            assert r["losses"] == pytest.approx(want["losses"], rel=1e-5)
    lines = named[0]["lines"]
    assert lines[0].startswith("stage 3 units, gathered and freed one by one: 3 x Block (blocks.0, blocks.1, blocks.2), ")
    assert "1 x Linear (head), 72 B each" in lines[0], lines
    assert not any("outer units" in line for line in lines), lines
    assert any("outer units, picked automatically" in line and "head 72 B" in line for line in auto[0]["lines"])


def test_the_run_says_why_a_unit_owns_no_parameter_and_what_the_root_holds(ranks):
    """A unit without parameters of its own is named with why (before: every one was said to share a weight
    with modules outside it, persistent norms and parameterless modules too); the root's parameters are named
    (before: only its bytes; here a Linear shared by two blocks), and training equals stage 0's."""
    pool = ranks(2)
    persistent = pool.run(cases.units_by_name, units=("Block", "LayerNorm"), persistence_threshold=32,
                          keep_root_bytes=0)[0]["lines"]
    assert ("stage 3: blocks.0.norm, blocks.1.norm, blocks.2.norm, head own no parameter of their own (persistent, "
            "zero.persistence_threshold): not units") in persistent, persistent  # the head: 17 elements
    tied = pool.run(cases.units_by_name, units=("Block",), tie=True)
    assert ("stage 3 parameters that stay gathered: root 1.1 KiB, blocks.0.fc.weight, blocks.0.fc.bias (through each "
            "forward and backward)") in tied[0]["lines"], tied[0]["lines"]
    # Note [Kept from forward to backward]: the root and the head, 1.1 KiB together, under zero.keep_root_bytes, and
    # with them the last block
    assert ("stage 3: the root and the outer units, 1.1 KiB together, are gathered once per micro-step and kept from "
            "each forward into its backward, not on the schedule above, and so is the unit the forward ends with where "
            "it fits with them (the last listed in the model's order, blocks.2 1.2 KiB) (zero.keep_root_bytes 1.00 "
            "MiB; 0 frees them after forward)"
            ) in tied[0]["lines"], tied[0]["lines"]
    # the same with a budget that holds the root and the head but not the last block
    small = pool.run(cases.units_by_name, units=("Block",), tie=True, keep_root_bytes=2048)
    assert ("stage 3: the root and the outer units, 1.1 KiB together, are gathered once per micro-step and kept from "
            "each forward into its backward, not on the schedule above (the unit the forward ends with too where it "
            "fits with them; the last listed in the model's order, blocks.2 1.2 KiB, does not) (zero.keep_root_bytes "
            "2.0 KiB; 0 frees them after forward)") in small[0]["lines"], small
    assert not any("into its backward" in line for line in persistent), persistent  # zero.keep_root_bytes 0
    for r, want in zip(tied, pool.run(cases.units_by_name, units=(), stage=0, tie=True)):
        assert r["losses"] == pytest.approx(want["losses"], rel=1e-5)


def test_a_unit_reading_another_units_weight_before_its_own_trains_as_stage_0(ranks):
    """A block reads another block's weight (tied by attribute) before its own parameters: the borrowed unit
    stays gathered until the reader's backward is over (before: freed with the reader's own gradients, while
    autograd still needed it for the reader's input gradient: 'storage of size 0' in backward)."""
    for first in (True, False):
        got = ranks(2).run(cases.borrow, stage=3, first=first)
        want = ranks(2).run(cases.borrow, stage=0, first=first)
        for r, w in zip(got, want):
            assert r["losses"] == pytest.approx(w["losses"], rel=1e-5), (first, r, w)
        assert got[0]["external"]["blocks.1"] == ["blocks.0"], got[0]


def test_after_a_forward_that_raised_a_read_between_steps_is_refused(ranks):
    """Before: the failed forward stayed 'running', so a read on rank 0 alone all-gathered its unit there (the
    next step hung) and recorded it as an external of the unit that raised."""
    r0, r1 = ranks(2).run(cases.read_after_failed_forward)
    assert "is partitioned" in r0["refused"], r0
    assert r0["external"] == r1["external"] and "blocks.2" not in r0["external"], (r0, r1)


def test_compiled_units_see_the_same_externals_and_tails_as_eager(ranks):
    """With torch.compile a unit that reads an outer unit's weight records what eager records (before: dynamo
    traced into the at-rest guard and made every other unit 'used outside its unit', and the final norm and
    head lost their tail schedule); the losses are eager's."""
    eager = ranks(2).run(cases.borrow, stage=3, emb=True)
    compiled = ranks(2).run(cases.borrow, stage=3, emb=True, compile_backend="aot_eager")
    for e, c in zip(eager, compiled):
        assert c["external"] == e["external"] and c["tails"] == e["tails"] and c["warnings"] == e["warnings"], (e, c)
        assert c["losses"] == pytest.approx(e["losses"], rel=1e-5)
    assert eager[0]["tails"] == ["head", "norm"], eager[0]


PEER_CASES = ["basic", "bias", "bucket", "persist", "subclass", "frozen", "reversed"]


@pytest.mark.parametrize("case", PEER_CASES)
def test_experts_of_different_layouts_routed_per_rank_are_a_clear_error(ranks, case):
    """Note [Peer units]: two experts in one ModuleList that differ in size, in their biases, in how their
    parameters split into buckets, in persistent or frozen parameters, or in class, each rank running another:
    the clear error on every rank before backward (before: gloo aborted rank 0 on the all-gathers' sizes and
    the other rank failed on the lost connection)."""
    for r in ranks(2).run(cases.experts, case=case, route="rank"):
        assert "reaches the loss on some ranks only" in r.get("error", ""), r
        assert "'experts.0'" in r["error"] and "'experts.1'" in r["error"], r


@pytest.mark.parametrize("case", PEER_CASES)
def test_the_estimate_counts_the_peer_units_padding(ranks, case):
    """``zerorun estimate``'s bytes sent per step equal zero/comm.py's count for experts of different layouts run
    by every rank, the padding of their all-gathers included (Note [Peer units]; before, it was left out), also
    where the last one, padded, is kept from forward to backward (``reversed``: found by review, its padding was
    counted twice)."""
    import torch

    from zerorun import estimate as est

    with torch.device("meta"):
        torch.manual_seed(0)
        model = cases.MoE(case, "all")
    config = {"bucket": {"bucket_mb": 0.002}, "persist": {"persistence_threshold": 32}}.get(case, {})
    layout = est.layout_of(model, units=("experts.0", "experts.1"), **config)
    want = est.comm_bytes(layout, 3, 2, est.precision_of("fp32", None))
    for r in ranks(2).run(cases.experts_traffic, case=case):
        assert r["padded"] and abs(r["sent"] - want) <= 8, (r, want)


@pytest.mark.parametrize("case", PEER_CASES)
def test_experts_that_all_run_train_as_stage_0_without_padding_at_rest(ranks, case):
    """The padded all-gathers change no number (stage 0's losses), and a rank keeps only its own slices at rest:
    stage 3 holds less than stage 0's whole parameters (before: the smaller expert's flat buffers were padded
    to the larger's, at rest too)."""
    got = ranks(2).run(cases.experts, case=case, route="all")
    want = ranks(2).run(cases.experts, case=case, route="all", stage=0)
    for r, w in zip(got, want):
        assert r["losses"] == pytest.approx(w["losses"], rel=1e-5), (r, w)
        assert r["param_bytes"] < w["param_bytes"] / 2 + 1024, (r, w)
    assert got[0]["gather_bytes"] and len(set(got[0]["gather_bytes"].values())) == 1, got[0]


def test_gathers_queued_together_leave_no_queue_behind_when_their_collective_raises():
    """Note [Units gathered together]: ``Gathering.together()`` issues its queue at the end of the block; when that
    collective raises (a peer gone), the queue goes with the error. Before, it was left empty but set, so every
    later ``together()`` block queued into it and nothing was issued until some wait."""
    import types

    import torch.nn as nn

    from zerorun.zero.units import Gathering

    class Failing:
        def all_gather_coalesced(self, outputs, inputs, message_bytes=0):
            raise RuntimeError("peer gone")

    ctx = Gathering(comm=Failing(), store=None, guard=nn.Parameter)
    with pytest.raises(RuntimeError, match="peer gone"):
        with ctx.together():
            ctx.pending.append(types.SimpleNamespace(buffers=[]))
    assert ctx.pending is None


@pytest.mark.parametrize("message", ["fetching the remote feature store timed out after 5 s",
                                     "feature store: Connection closed by peer"])
def test_a_users_error_that_mentions_a_timeout_is_not_taken_for_a_collectives(ranks, message):
    """Only gloo's and NCCL's wordings of a collective that timed out, or of a peer that closed its connection,
    are rewritten (before: any RuntimeError saying "timed out", which became "waiting for the all-gather of
    'b'")."""
    for error in ranks(2).run(gather_group_cases.user_error_mentioning_a_timeout, message=message):
        assert error == message, error


def test_a_peer_that_closed_its_connection_gets_the_same_line_as_a_timeout():
    """The rank that times out first closes its connections, so a peer waiting in another collective sees gloo's
    "Connection closed by peer" rather than a timeout of its own (which rank is first is a race: the test below
    failed 3 times in 12). That rank's line names its units too, and stays a peer failure (Note [Blame])."""
    import types

    from zerorun.rank.worker import is_peer_failure
    from zerorun.zero.stage3_checks import timed_out
    from zerorun.zero.units import UnitState

    units = [types.SimpleNamespace(name=n, state=UnitState.FREE) for n in ("", "a", "b")]
    engine = types.SimpleNamespace(units=units, rank=1, comm=types.SimpleNamespace(global_rank=lambda r: r),
                                   gathering=types.SimpleNamespace(log=[0, 1, 2]))
    closed = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
                          "[127.0.0.1]:40043")
    error = str(timed_out(engine, closed, "the agreement before backward"))
    assert error.startswith("stage 3: rank 1 lost a peer (it timed out or failed) in the agreement before "
                            "backward. The units this rank all-gathered in this step, in order: '<root>', 'a', "
                            "'b'."), error
    assert is_peer_failure(RuntimeError(error))
    assert timed_out(engine, RuntimeError("Connection closed by peer"), "forward") is None


@pytest.mark.slow
def test_a_unit_run_on_some_ranks_times_out_with_the_units_each_rank_gathered():
    """A unit whose forward runs on rank 0 only (Note [Same units on every rank]: no check can see it before its
    all-gather without a collective of its own) hangs until the collective timeout; then every rank raises one
    clear error naming where it waited and the units it gathered, not gloo's ("Timed out waiting 5000ms for recv
    operation to complete"). Its own pool: the timed-out group is left broken."""
    pool = RankPool(2, timeout=120)
    try:
        errors = pool.run(gather_group_cases.unit_on_some_ranks, timeout_s=5)
    finally:
        pool.close(kill=True)
    assert re.match(f"stage 3: rank 0 {_HOW} in forward, waiting for the all-gather of 'b'", errors[0]), errors
    assert re.match(f"stage 3: rank 1 {_HOW} in the agreement before backward", errors[1]), errors
    assert "in order: '<root>', 'a', 'extra', 'b'." in errors[0] and "in order: '<root>', 'a', 'b'." in errors[1]
    assert all("or use stage 2" in e for e in errors), errors


@pytest.mark.slow
def test_a_unit_called_more_times_on_some_ranks_times_out_the_same_way():
    """A unit called once more on rank 1 (a loop over it as long as each rank's own sequence) gathers once more
    there: the same kind as a unit run on some ranks only (it hung until the pool's timeout in a review), and the
    same error on every rank after the collective timeout, each naming the units it gathered. (Here the unit is
    the last, and ``zero.keep_root_bytes`` 0, so that it is freed after each call: kept, it trains as stage 0,
    ``test_the_last_unit_called_more_times_on_some_ranks_trains_as_stage_0``.)"""
    pool = RankPool(2, timeout=120)
    try:
        errors = pool.run(gather_group_cases.unit_on_some_ranks, timeout_s=5, net="loop", keep=0)
    finally:
        pool.close(kill=True)
    assert re.match(f"stage 3: rank 0 {_HOW} in the agreement before backward", errors[0]), errors
    assert re.match(f"stage 3: rank 1 {_HOW} in forward, waiting for the all-gather of 'b'", errors[1]), errors
    assert "in order: '<root>', 'a', 'b'." in errors[0] and "in order: '<root>', 'a', 'b', 'b'." in errors[1]


def test_the_last_unit_called_more_times_on_some_ranks_trains_as_stage_0(ranks):
    """Note [Kept from forward to backward]: the last unit, kept gathered from its first call into backward, needs
    no second all-gather for a second call on one rank: the same losses as stage 0."""
    want = ranks(2).run(gather_group_cases.loop_net, stage=0)
    for got, w in zip(ranks(2).run(gather_group_cases.loop_net, stage=3), want):
        assert got == pytest.approx(w, rel=1e-5), (got, w)


@pytest.mark.slow
def test_a_state_dict_asked_on_one_rank_only_is_one_line_after_the_timeout():
    """``if rank == 0: torch.save(engine.state_dict(), ...)``, the DDP habit, all-gathers every unit at stage 3
    on rank 0 alone: it waits for the collective timeout, then says why in one line (before: gloo's "Timed out
    waiting 3000ms for send operation"). Its own pool: the timed-out group is left broken."""
    pool = RankPool(2, timeout=120)
    try:
        errors = pool.run(gather_group_cases.state_dict_on_rank0_only, timeout_s=3)
    finally:
        pool.close(kill=True)
    assert errors[0].startswith("stage 3: rank 0 timed out in full_state_dict() or lost its peer there: it "
                                "all-gathers every unit, so every rank must call it"), errors


def test_stage_3_on_cpu_trims_glibcs_heap_before_each_backward(ranks):
    """Note [Trimmed before backward] in zerorun/zero/allocator.py: once per backward at stage 3 (whose units the
    forward freed), not at stage 2."""
    assert ranks(2).run(cases.trims_before_backward, stage=3) == [3, 3]
    assert ranks(2).run(cases.trims_before_backward, stage=2) == [0, 0]
