"""Stage 3's outer units (Note [Outer units] in zerorun/zero/stage3_outer.py): the embeddings, final norm and
LM head outside the listed units are gathered only around their own use, on a schedule every rank learned in
the first step; the numbers stay stage 0's, and a module that leaves its schedule is an error, never a hang
or a read of freed memory."""

import pytest

import outer_cases as cases

pytestmark = pytest.mark.slow


def test_outer_units_are_gathered_only_around_their_use(ranks):
    """From the second step on, the token embedding is not gathered while any block runs forward or while the
    last three blocks run backward, the final norm and head not while the blocks run backward; the most
    parameter bytes gathered while a block runs drops by at least the embedding's share. (Before: the whole root, these
    three included, was gathered through the whole forward and backward.)"""
    r = ranks(2).run(cases.gathered_at_points)[0]
    kept = ranks(2).run(cases.gathered_at_points, with_root=True)[0]  # the embedding kept with the root
    assert "wte" in dict(kept["steps"][1]["points"])["forward 2"]
    for step, before in zip(r["steps"][1:], kept["steps"][1:]):
        points = dict(step["points"])
        for i in range(4):
            assert "wte" not in points[f"forward {i}"], step
        for i in (1, 2, 3):
            assert "wte" not in points[f"backward {i}"], step
        for i in (0, 1, 2):
            assert not {"ln_f", "head"} & set(points[f"backward {i}"]), step
        # tails: not through the loss's backward, gathered when the logits' gradient comes
        assert not {"ln_f", "head"} & set(points["loss backward"]), step
        assert step["max_bytes"] <= before["max_bytes"] - r["sizes"]["wte"], (step, before)
    first = dict(r["steps"][0]["points"])  # the first step learns: the outer units are gathered with the root
    assert {"wte", "ln_f", "head"} <= set(first["forward 1"])
    assert {"ln_f", "head"} <= set(first["loss backward"])


def test_a_small_root_and_its_outer_units_stay_gathered_from_forward_into_backward(ranks):
    """Note [Kept from forward to backward]: with ``zero.keep_root_bytes`` at its default (1 MiB), TinyGPT's
    embedding, final norm and head (a few KiB with the root) are all-gathered once per step, at the start of the
    forward, from the first step on; they stay gathered through the forward and the loss's backward, and the final
    norm and head are freed once their gradient is complete, before the blocks' backward. With 0 (the other
    cases) the final norm and head are all-gathered twice a step and not held through the loss's backward.
    (Before: twice, whatever their size, with saved-tensor hooks over the whole forward.)"""
    kept = ranks(2).run(cases.gathered_at_points, keep=None)[0]
    freed = ranks(2).run(cases.gathered_at_points)[0]
    for step in kept["steps"]:
        points = dict(step["points"])
        for i in range(4):
            assert {"wte", "ln_f", "head"} <= set(points[f"forward {i}"]), step
        assert {"ln_f", "head"} <= set(points["loss backward"]), step
        for i in (0, 1, 2):
            assert not {"ln_f", "head"} & set(points[f"backward {i}"]), step
        assert step["gathers"] == {"wte": 1, "ln_f": 1, "head": 1}, step
    for other in freed["steps"][1:]:
        assert (other["gathers"]["ln_f"], other["gathers"]["head"]) == (2, 2), other


@pytest.mark.parametrize("kw", [{}, {"accum": 2}, {"checkpointing": True}, {"tied": True},
                                {"head_by_weight": True}, {"evaluate": True},
                                {"extras": ["start"]}, {"extras": [{0: "start", 1: None}]},
                                {"extras": ["end", {0: "end", 1: None}, {0: None, 1: "end"}]},
                                {"extras": ["start"], "skips": [[1], [0, 3], [], [0, 1, 2, 3]]},
                                {"latents": True}, {"hook_after": True},
                                {"accum": 2, "extras": [["start", "end"], "start"]}, {"interrupt": True},
                                {"accum": 2, "experts": [[(0, 1, 2), (0, 1, 2)], [(2,), (0, 2)], [(0, 2), (2,)]]},
                                {"extras": ["end", {0: "end", 1: "start"}]},
                                {"extras": ["end", {0: "end", 1: "start"}, "start"], "head_by_weight": True,
                                 "final_norm": False},
                                {"head_penalty": True}, {"penalty_from": 1}, {"detach_aux": True},
                                {"probe": True, "probe_from": 1}, {"frozen_wte": True},
                                {"block_reads": "head"}, {"block_reads": "ln_f"}, {"block_reads": "head.data"},
                                {"grad_eval": True, "accum": 2}],
                         ids=["plain", "accum", "checkpointing", "tied", "head-by-weight", "evaluate",
                              "extra-everywhere", "extra-on-rank0", "extra-later-on-one-rank", "layerdrop",
                              "returns-a-view", "hook-added-later", "moves-between-micro-steps",
                              "forward-interrupted-before-step", "root-experts-vary-by-micro-step",
                              "tail-moves-on-one-rank", "only-tail-late-on-one-rank",
                              "penalty-inside-the-head", "root-penalty-from-step-2", "aux-loss-on-detached-head",
                              "block-reads-the-head-off-its-output-from-step-2", "frozen-embedding",
                              "block-reads-the-head-detached", "block-reads-the-final-norm-detached",
                              "block-reads-the-heads-data", "forward-without-backward-before-step"])
def test_stage3_with_outer_units_equals_stage0(ranks, kw):
    """Losses and grad norms equal stage 0's (fp32, 1e-5 relative) on 2 ranks, also when the blocks that run
    change from step to step (LayerDrop, the first block included); a module that ran before the first block
    on every rank (in every micro-step) is scheduled, the rest (the head, a module one rank skipped, a tied
    weight, a module that returns a view of its parameter: read after its unit would be freed) stays with the
    root in forward, and those whose outputs' gradient came before any block's backward on every rank (the
    final norm, the head, a module run after the blocks on both ranks) are tails: in backward gathered when that
    gradient comes, or with the root in a backward whose loss does not reach them on every rank (``extra``
    later run by one rank only); a forward hook that reads the embedding's weight detached, added after the
    first step, reads stage 0's values; a forward that raises half way before the optimizer step leaves no
    stale gathered copy; root experts (one outer unit) that change between micro-steps are not freed while one
    still needs its weight; a tail whose gradient comes after the blocks' backward began, on one rank or on
    both (the only tail, ``extra``, moved before the blocks), is gathered before the first block's all-gather
    on that rank, so the all-gathers stay in the same order on every rank; and a tail whose weight autograd
    reads before its output's gradient comes (a penalty computed inside the head, one the root adds from step
    2 on, an auxiliary loss through the detached weight, a block called after the head whose side loss reads
    the head's weight from step 2 on) is gathered before that read; a frozen embedding, through which no
    gradient flows, trains as stage 0; a block whose side loss reads the head's or the final norm's weight
    detached or through ``.data`` (an alias autograd saves, which no gradient of theirs waits for) keeps them
    gathered to the end of backward (before: freed once their own gradient was complete; "storage of size 0", or
    a segfault). All of it again with the root and the outer units with it kept gathered from forward into
    backward (``zero.keep_root_bytes`` at its default: Note [Kept from forward to backward]; the other runs set
    0), a forward with gradients on whose loss no backward follows before the step included (what it keeps must
    not outlive the step)."""
    pool = ranks(2)
    s3 = pool.run(cases.train, stage=3, **kw)
    s0 = pool.run(cases.train, stage=0, **kw)
    kept = pool.run(cases.train, stage=3, keep=None, **kw)
    assert s3[0]["kept"] == [] and kept[0]["kept"] == kept[1]["kept"], kept  # the root and every outer unit
    assert set(kept[0]["kept"]) == {"<root>"} | set(kept[0]["schedule"]), kept[0]
    for a, b in zip(s3 + kept, s0 + s0):
        assert a["error"] is None and b["error"] is None, (a["error"], b["error"])
        assert a["losses"] == pytest.approx(b["losses"], rel=1e-5)
        assert a["norms"] == pytest.approx(b["norms"], rel=1e-5)
        assert a["reads"] == pytest.approx(b["reads"], rel=1e-5) and len(a["reads"]) == len(b["reads"])
    schedule, tails = s3[0]["schedule"], s3[0]["tails"]
    assert s3[0]["schedule"] == s3[1]["schedule"] and tails == s3[1]["tails"]
    # tails (gathered in backward when their outputs' gradient comes): the final norm always, the head unless
    # the root reads its weight; ``extra`` where it ran after the blocks on both ranks in the first step
    # (or reads it through .data: a use, as p.data hands out the values)
    assert tails.get("ln_f", True) and tails.get("head", True) == (
        not kw.get("head_by_weight") and kw.get("block_reads") != "head.data"), tails
    assert tails["extra"] == (kw.get("extras", [None])[0] == "end"), tails
    assert not tails["experts"], tails  # its Linears run, not the ModuleList: read outside its forward
    if kw.get("tied"):  # the tied weight is the root's: neither module holds a parameter of its own
        assert "wte" not in schedule and "head" not in schedule, schedule
    else:  # gathered again when the first block's backward begins (frozen: at its start); the head runs after
        assert schedule["wte"] == (True, 0 if kw.get("frozen_wte") else 1), schedule  # the first block
        assert schedule["head"] == (False, None), schedule
    assert schedule["extra"][0] == (kw.get("extras", [None])[0] == "start"), schedule
    if kw.get("latents"):
        assert schedule["latents"] == (False, None), schedule


def test_a_module_that_leaves_its_schedule_is_an_error_and_declaring_it_keeps_it_with_the_root(ranks):
    """``extra`` runs before the blocks in the first step and after them in the second, on both ranks: each
    raises, naming the module and register_external_parameter; declared so, it stays with the root and the
    numbers are stage 0's."""
    pool = ranks(2)
    moved = pool.run(cases.train, stage=3, steps=3, extras=["start", "end"])
    for r in moved:
        assert r["error"] is not None and "'extra'" in r["error"], r
        assert "register_external_parameter(model, param)" in r["error"], r
        assert len(r["norms"]) == 1, r
    declared = pool.run(cases.train, stage=3, steps=3, extras=["start", "end"], declare=True)
    s0 = pool.run(cases.train, stage=0, steps=3, extras=["start", "end"])
    for a, b in zip(declared, s0):
        assert a["error"] is None and a["schedule"]["extra"][0] is False, a
        assert a["losses"] == pytest.approx(b["losses"], rel=1e-5)


def test_a_tail_read_in_backward_before_its_gather_is_an_error(ranks):
    """A hook on the loss that reads the head's weight with gradients on, from the second step: the head, a tail,
    is not gathered yet there (Note [Outer units]); every rank raises, naming it and
    register_external_parameter, instead of reading its freed storage."""
    for r in ranks(2).run(cases.train, stage=3, steps=2, read_in_backward=True):
        assert r["error"] is not None and "'head'" in r["error"], r
        assert "register_external_parameter(model, param)" in r["error"], r
        assert len(r["norms"]) == 1 and r["tails"]["head"], r


@pytest.mark.parametrize("kw,name", [({"max_norm": True}, "wte.weight"), ({"root_writes": True}, "ln_f.weight"),
                                     ({"root_writes": "blocks.3"}, "blocks.3.down.bias"),
                                     ({"root_writes": "blocks.0"}, "blocks.0.down.bias")],
                         ids=["embedding-max-norm", "root-clamps-the-final-norm", "root-writes-the-last-block",
                              "root-writes-the-first-block"])
def test_a_write_to_an_outer_parameter_inside_the_forward_is_an_error(ranks, kw, name):
    """An in-place write during the forward to an outer unit's parameter (nn.Embedding's max_norm, the root
    clamping the final norm's weight), or by the root to a block's after the block ran (found by review: lost
    without a word, 1e-2 off stage 0, kept from forward to backward or gathered again), would change a gathered
    copy only and be lost: an error naming the parameter on every rank, as for a write inside a listed unit's own
    forward (Note [Writes inside a unit's forward]); stage 0 trains."""
    pool = ranks(2)
    for keep in (0, None):
        for r in pool.run(cases.train, stage=3, steps=2, keep=keep, **kw):
            assert r["error"] is not None and "written in place" in r["error"] and repr(name) in r["error"], r
    for r in pool.run(cases.train, stage=0, steps=2, **kw):
        assert r["error"] is None, r


@pytest.mark.parametrize("between", ["penalty", "write_bias", "detach_head", "gathered_write_bias",
                                     "gathered_detach_head", "detach_last_block"])
def test_user_code_between_a_forward_and_its_backward_is_refused_as_at_rest(ranks, between):
    """Note [Kept from forward to backward]: reading or writing a kept unit's weight between a forward and its
    backward is refused on every rank, as where the unit is freed (keep 0), whatever the sizes (here from the
    second step on, after the first has learned; found by review: a detached alias of the head's weight read after
    backward segfaulted both ranks; a write to a kept bias there was lost, 8e-2 off stage 0; a penalty there was
    taken or refused by size; and the same two after an empty ``gathered_parameters`` block, which had ended the
    guard: a segfault, 0.86 off)."""
    for keep in (None, 0):
        for r in ranks(2).run(cases.train, stage=3, keep=keep, between=between):
            assert len(r["losses"]) == 1 and r["error"].startswith(("stage 3: parameter 'head.weight'",
                                                                "stage 3: parameter 'ln_f.bias'",
                                                                "stage 3: parameter 'blocks.3.up.weight'")), (keep, r)
            assert "outside a forward or backward" in r["error"] and "gathered_parameters" in r["error"], r


@pytest.mark.parametrize("kw", [{}, {"head_by_weight": True}, {"extras": ["start"]}, {"accum": 2},
                                {"latents": True}, {"block_penalty": True}],
                         ids=["plain", "head-by-weight", "extra-first", "accum", "latents", "root-reads-a-block"])
def test_the_estimate_counts_what_the_engine_sends_whatever_the_first_step_schedules(ranks, kw):
    """``zerorun estimate``'s bytes per step equal the engine's from the second step on, kept or not: the kept
    units are the root and every outer unit, whatever the first step schedules (found by review: the estimate
    guessed the scheduled ones, embeddings and modules registered before the blocks, and was 64-256 bytes off
    for a position table read by weight and a final norm registered before the blocks; the engine kept nothing
    where the root read a block's weight, which the estimate cannot see: that block is now gathered again when
    backward begins, with the root kept)."""
    import torch

    from outer_cases import TinyGPT
    from zerorun import estimate as est

    model_kw = {k: v for k, v in kw.items() if k in ("head_by_weight", "latents", "block_penalty")}
    with torch.device("meta"):
        model = TinyGPT(**model_kw)
    for keep in (None, 0):
        layout = est.layout_of(model, units=("Block",), weight_decay=0.01, keep_root_bytes=keep)
        want = est.comm_bytes(layout, 3, 2, est.precision_of("fp32", None), kw.get("accum", 1))
        for r in ranks(2).run(cases.train, stage=3, keep=keep, **kw):
            assert r["error"] is None and all(abs(s - want) <= 8 for s in r["sent"][1:]), (keep, want, r["sent"])


@pytest.mark.parametrize("between", ["probe", "last_block"])
def test_a_block_called_between_a_forward_and_its_backward_reads_a_kept_weight_as_stage_0(ranks, between):
    """A listed unit called directly between a forward and its backward trains as stage 0, kept or not: a probe
    whose side loss reads the head's weight inside its forward (found by review: refused as a read at rest once the
    head was kept, where it had trained), and the last block, itself kept from the forward by default (Note [Kept
    from forward to backward])."""
    s0 = ranks(2).run(cases.train, stage=0, probe=True, between=between)
    for keep in (None, 0):
        for a, b in zip(ranks(2).run(cases.train, stage=3, probe=True, between=between, keep=keep), s0):
            assert a["error"] is None and b["error"] is None, (keep, a["error"], b["error"])
            assert a["losses"] == pytest.approx(b["losses"], rel=1e-5) and len(a["losses"]) == 4, keep
            assert a["norms"] == pytest.approx(b["norms"], rel=1e-5), keep


def test_the_last_unit_kept_on_some_ranks_only_is_gathered_again_on_every_rank(ranks):
    """Note [Kept from forward to backward]: whether the last unit of the forward stays gathered into backward is
    agreed before backward; where one rank did not keep it, every rank frees it and all-gathers it again when its
    backward begins (before: that rank alone issued the all-gather, a mismatch), and the step trains as stage 0's."""
    s0 = ranks(2).run(cases.train, stage=0, steps=3)
    got = ranks(2).run(cases.kept_on_one_rank)
    both = ranks(2).run(cases.train, stage=3, steps=3, keep=None)
    for a, b in zip(got, s0):
        assert a["error"] is None and a["losses"] == pytest.approx(b["losses"], rel=1e-5), (a, b)
        assert a["norms"] == pytest.approx(b["norms"], rel=1e-5), (a, b)
    assert got[0]["sent"][1:] == got[1]["sent"][1:], got  # the same all-gathers on both ranks
    assert all(x > y for x, y in zip(got[0]["sent"][1:], both[0]["sent"][1:])), (got[0]["sent"], both[0]["sent"])
