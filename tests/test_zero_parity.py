"""Every ZeRO stage trains to the same numbers as torch's DDP (fp32: within 1e-5 relative per step).

Note [Summation-order floor]: fp32 addition is not associative. Wherever ZeRO must add gradients in another
order than DDP (3 or more ranks with another bucket layout; stage 2, which reduces every micro-step instead
of accumulating locally first), Adam divides by sqrt(v) + eps and amplifies those ulp-level differences in
near-zero gradient elements (up to lr * δg / eps per step). Each case therefore also trains a second DDP that
differs from the first only in summation order (another ``bucket_cap_mb``, all-reduce on every micro-step,
the clipping norm summed over one flat vector instead of per parameter).
Losses, grad norms (at every step) and final parameters are each held to 1e-5, or to 4x the DDP-vs-DDP
distance of the same quantity measured in the same run where that floor is larger (measured: 0 for 2 ranks
without accumulation, so those cases are held to 1e-5; for the tiny GPT under Adam at lr 1e-3 with 3 ranks
about 1e-4 on parameters; at lr 1e-2 its training is chaotic enough that this drift reaches 1e-5 in the grad
norm within 20 steps). Evaluation losses and
BatchNorm buffers are always held to 1e-5.
"""

import copy

import pytest

import broadcast_cases
import parity_cases as cases

TOL = 1e-5
_RUNS: dict = {}


def shared_run(ranks, world_size: int, fn, **kwargs) -> list:
    """``ranks(world_size).run(fn, **kwargs)`` once per session for the same arguments: tests that assert
    different things of one run (the parity of 2 ranks and its zero floor; the bytes held and the bytes sent)
    read the same results (a copy each) instead of training it again."""
    key = (world_size, fn.__name__, repr(sorted(kwargs.items())))
    if key not in _RUNS:
        _RUNS[key] = ranks(world_size).run(fn, **kwargs)
    return copy.deepcopy(_RUNS[key])


def check(results: list[dict]) -> None:
    for rank, r in enumerate(results):
        assert r["floor_params"] < 2e-3, f"rank {rank}: DDP-vs-DDP floor implausibly large: {r}"
        tol = {key: max(TOL, 4 * r.get("floor_" + key, 0.0)) for key in ("loss", "grad_norm", "params")}
        for key, tol in (("loss", tol["loss"]), ("grad_norm", tol["grad_norm"]), ("params", tol["params"]),
                         ("buffers", TOL), ("eval", TOL)):
            assert r[key] <= tol, f"rank {rank}: {key} differs from DDP by {r[key]:.3g} relative ({r})"


@pytest.mark.parametrize("model,stage,world_size", [
    pytest.param(model, stage, world_size, id=f"{model}-{stage}-{world_size}",
                 # the fast tier's parity check, one per stage (Note [Test tiers] in conftest.py)
                 marks=pytest.mark.smoke if (model, world_size) == ("gpt", 2) else ())
    for model in ("gpt", "mlp") for stage in (0, 1, 2, 3) for world_size in (2, 3)])
def test_matches_ddp(ranks, world_size, stage, model):
    check(shared_run(ranks, world_size, cases.parity, stage=stage, model=model))


def test_two_ranks_are_exact(ranks):
    """With 2 ranks and no accumulation the summation order cannot differ: no floor, 1e-5 everywhere."""
    for r in shared_run(ranks, 2, cases.parity, stage=1, model="gpt"):  # test_matches_ddp[gpt-1-2]'s run
        assert r["floor_params"] == 0.0 and r["params"] <= TOL, r


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_world_size_3_sgd_is_exact(ranks, stage):
    """Without Adam's 1/eps amplification, 3 ranks with padding hold 1e-5 on the parameters too."""
    check(ranks(3).run(cases.parity, stage=stage, model="gpt", optimizer="SGD",
                       optimizer_kwargs={"lr": 0.5, "momentum": 0.9, "weight_decay": 0.01}))


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("accum,clip", [(3, None), (1, 0.05), (2, 0.05)])
@pytest.mark.parametrize("model,world_size", [("gpt", 2), ("mlp", 3)])
def test_accumulation_and_clipping(ranks, stage, accum, clip, model, world_size):
    check(ranks(world_size).run(cases.parity, stage=stage, model=model, accum=accum, clip=clip))


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("structure", [
    {"frozen": True},
    {"branch": True, "branch_pattern": "mixed"},
    {"batchnorm": True},
    {"groups": "custom"},
    {"twice": True},
], ids=["frozen", "unused-branch", "batchnorm", "param-groups", "unit-called-twice"])
def test_structures(ranks, stage, structure):
    if stage == 3 and structure.get("branch_pattern") == "mixed":
        # Stage 3 all-gathers a unit on every rank together: a unit that runs on some ranks only would leave
        # the others out of the collective (as in FSDP and DeepSpeed ZeRO-3). Branches taken by all ranks or
        # none are fine.
        structure = dict(structure, branch_pattern="uniform")
    check(ranks(3).run(cases.parity, stage=stage, model="mlp", **structure))


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("optimizer,kwargs", [
    ("Adam", {"lr": 1e-2}),
    ("SGD", {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}),
    ("Adagrad", {"lr": 0.05}),
])
def test_optimizers(ranks, stage, optimizer, kwargs):
    check(ranks(2).run(cases.parity, stage=stage, optimizer=optimizer, optimizer_kwargs=kwargs))


@pytest.mark.parametrize("tie", [True, False])
def test_tied_and_untied_embedding(ranks, tie):
    """The GPT's LM head shares the token embedding: one parameter, reduced once, still equal to DDP."""
    tied = {} if tie else {"tie_embeddings": False}  # tied is the GPT's default: test_matches_ddp[gpt-2-2]'s run
    check(shared_run(ranks, 2, cases.parity, stage=2, model="gpt", **tied))


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_reported_bytes_match_zero_paper(ranks, world_size, stage):
    """ZeRO §5, fp32 AdamW: stage 0 16Ψ; stage 1 4Ψ + 4Ψ + 8Ψ/N; stage 2 4Ψ + 12Ψ/N; stage 3 16Ψ/N
    (Ψ with padding; at stage 3 the parameters at rest are this rank's slices only)."""
    for r in shared_run(ranks, world_size, cases.memory, stage=stage, units=("Block",) if stage == 3 else ()):
        n, padded = r["world_size"], r["padded"]
        expected = cases.paper_bytes(stage, padded, n, 4, 4, 8)
        got = r["bytes"]
        assert (got["params"], got["grads"]) == expected[:2]
        # plus one 4-byte step counter per optimizer tensor (AdamW keeps 'step' as a tensor)
        assert expected[2] <= got["optimizer"] <= expected[2] + 4 * 64
        assert 0 <= padded - r["psi"] < n * 64  # at most N-1 padding elements per flat buffer


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bytes_sent_per_step(ranks, stage):
    """Ring collectives, ZeRO §7: stage 0 all-reduce, stages 1-2 reduce-scatter + all-gather: 2Ψ(N-1)/N x 4 bytes;
    stage 3 all-gathers twice (forward, backward) and reduce-scatters once: 3Ψ(N-1)/N x 4 bytes, but the root, the
    outer units and the last block kept from forward to backward (here the tiny GPT's, Note [Kept from forward to
    backward] in zerorun/zero/stage3_outer.py), gathered once (plus the 8-byte global-norm all-reduce at stages 1-3,
    fp64: Note [Gradient norm]; the digest of the units gathered and the outer units' windows are agreed on the
    host, control traffic not counted: Note [Agreements on the host] in zerorun/zero/comm.py)."""
    for r in shared_run(ranks, 3, cases.memory, stage=stage, units=("Block",) if stage == 3 else ()):
        n, padded = r["world_size"], r["padded"]
        assert (r["kept"] > 0) == (stage == 3), r
        assert r["kept_units"] == (["blocks.1", "pos_emb", "ln_f", ""] if stage == 3 else []), r
        expected = ((3 if stage == 3 else 2) * padded - r["kept"]) * (n - 1) // n * 4
        extra = 0 if stage == 0 else round(2 * (n - 1) / n * 8)
        assert r["comm"]["bytes_sent"] == expected + extra


@pytest.mark.parametrize("world_size", [2, 3])
def test_stage3_meta_construction_equals_normal(ranks, world_size):
    for r in ranks(world_size).run(cases.deferred_equals_normal):
        assert r["keys"] and r["equal"] and r["rng"], r
        # the listed units, the outer units (Note [Outer units]; the tied embedding and head stay the root's), the root
        assert r["units"] == ["blocks.0", "blocks.1", "blocks.2", "pos_emb", "ln_f", ""]


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("options", [
    {"deferred": True},
    {"activation_checkpointing": True},
    {"activation_checkpointing": True, "accum": 2, "clip": 0.05},
    {"tie_embeddings": False},
    {"prefetch_bytes": 0},
    {"prefetch_bytes": 1 << 40, "accum": 2, "clip": 0.05},
], ids=["meta-init", "activation-checkpointing", "checkpointing-accum-clip", "untied", "no-prefetch",
        "prefetch-whole-pass"])
def test_stage3_options_match_ddp(ranks, world_size, options):
    check(ranks(world_size).run(cases.parity, stage=3, model="gpt", units=("Block",), **options))


def test_stage3_weight_tied_across_units(ranks):
    """With the embedding a unit of its own, the LM head (root) shares its weight: the weight goes to the root."""
    check(ranks(2).run(cases.parity, stage=3, model="gpt", units=("Embedding", "Block")))


@pytest.mark.parametrize("keep", [0, None])
def test_stage3_records_unit_order_and_prefetches(ranks, keep):
    """Note [Prefetch]: in step 2 every block is already being gathered (prefetched) when its turn comes, but
    backward's first: the root's backward (the loss and the head, before any block) prefetches nothing. With
    ``zero.keep_root_bytes`` 0 that block is gathered when its backward begins; by default (this model's root,
    outer units and last block are small: Note [Kept from forward to backward]) it was kept from the forward."""
    for r in ranks(2).run(cases.prefetch_order, keep=keep):
        assert r["forward"] == ["", "blocks.0", "blocks.1"]
        assert r["backward"] == ["", "blocks.1", "blocks.0"]
        blocks = [(name, state) for name, state in r["states_at_use"] if name.startswith("blocks")]
        assert blocks == [("blocks.0", "gathering"), ("blocks.1", "gathering"),
                          ("blocks.1", "free" if keep == 0 else "gathered"), ("blocks.0", "gathering")], r


def test_stage3_prefetch_bytes_bounds_what_is_gathered_ahead(ranks):
    """zero.prefetch_bytes (Note [Prefetch]): the blocks after the one in use whose bytes fit are all-gathered
    then; 0: none ahead; unset: the next one. 4 blocks of equal size b; forward order root, blocks 0-3."""
    b = ranks(2).run(cases.prefetch_order, n_layer=4)[0]["block_bytes"]
    assert len(set(b)) == 1, b
    issued = {}
    for name, limit in (("next", None), ("none", 0), ("two", 2 * b[0]), ("under two", 2 * b[0] - 1),
                        ("all", 1 << 40)):
        got = ranks(2).run(cases.prefetch_order, prefetch_bytes=limit, n_layer=4)
        assert got[0]["issued"] == got[1]["issued"], got  # the same all-gathers at the same points on every rank
        issued[name] = [(unit, phase, at) for unit, phase, at in got[0]["issued"] if unit.startswith("blocks")]
    fwd = [f"blocks.{i}" for i in range(4)]
    bwd = fwd[::-1]

    def expected(order, phase, ahead):  # unit i+1..i+ahead issued when unit i starts, in forward the root's
        seq = ["", *order]  # first; in backward the root issues none: its first block is gathered when it begins
        first = 1 if phase == "forward" else 2
        return [(seq[j], phase, seq[max(first - 1, j - ahead)]) for j in range(first, len(seq))]

    assert issued["next"] == expected(fwd, "forward", 1) + expected(bwd, "backward", 1)
    assert issued["none"] == []
    assert issued["two"] == expected(fwd, "forward", 2) + expected(bwd, "backward", 2)
    assert issued["under two"] == issued["next"]
    assert issued["all"] == expected(fwd, "forward", 4) + expected(bwd, "backward", 4)


@pytest.mark.parametrize("world_size", [2, 3])
def test_stage3_persistent_parameters_match_ddp(ranks, world_size):
    """zero.persistence_threshold: small parameters stay whole (Note [Persistent parameters]); training still
    equals DDP, with meta-device construction, accumulation and clipping."""
    check(ranks(world_size).run(cases.parity, stage=3, model="gpt", units=("Block",), persistence_threshold=100,
                                deferred=True, accum=2, clip=0.05))


def test_stage3_persistent_parameters_bytes(ranks):
    """Persistent parameters are held whole (their bytes count N times a slice) and cost one all-gather per
    step (after the optimizer step) instead of two; the others as in ZeRO §5 and §7 (the kept units once: Note
    [Kept from forward to backward])."""
    for r in ranks(3).run(cases.memory, stage=3, units=("Block",), persistence_threshold=100):
        n, padded, pers = r["world_size"], r["padded"], r["persistent"]
        assert pers > 0 and r["persistent_params"] and all(
            name.endswith(("ln1.weight", "ln1.bias", "ln2.weight", "ln2.bias", "ln_f.weight", "ln_f.bias", ".bias"))
            for name in r["persistent_params"]), r["persistent_params"]
        assert r["bytes"]["params"] == (padded // n + pers) * 4
        # the norm (the unit digest and the outer units' windows are agreed on the host, not counted)
        step = (3 * (padded - pers) + 2 * pers - r["kept"]) * (n - 1) // n * 4 + round(2 * (n - 1) / n * 8)
        construction = pers * (n - 1) // n * 4  # the persistent parameters are all-gathered once when built
        assert r["comm"]["bytes_sent"] == step + construction


@pytest.mark.parametrize("freeze,threshold", [(("attn.qkv",), 500), (("ln1",), 0)])
def test_stage3_frozen_parameters_used_after_the_units_last_gradient(ranks, freeze, threshold):
    """A frozen weight used in backward after the unit's last trainable gradient (frozen qkv with the small
    parameters persistent; a frozen first norm) must still be gathered then: such a unit is freed at the end
    of backward (it used to be freed early, and backward then read freed storage)."""
    check(ranks(2).run(cases.parity, stage=3, model="gpt", units=("Block",), persistence_threshold=threshold,
                       freeze=freeze, steps=6))


def test_stage3_root_left_empty_by_persistence_still_records_the_forward(ranks):
    for r in ranks(2).run(cases.root_left_empty, persistence_threshold=1100):
        assert r["root_buffers"] == 0 and r["persistent"] > 0, r
        assert r["forward"] == ["", "blocks.0", "blocks.1"] and r["seen"] == 0, r


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_default_bucket_size_and_sgd(ranks, stage):
    """The default 25 MiB bucket (every model here fits one bucket: all of backward before one reduction), and
    SGD at every stage, stage 0 included (Adam's normalisation hides a per-bucket scale error)."""
    units = ("Block",) if stage == 3 else ()
    check(ranks(2).run(cases.parity, stage=stage, model="gpt", bucket_mb=25.0, units=units))
    check(ranks(3).run(cases.parity, stage=stage, model="gpt", bucket_mb=25.0, units=units, optimizer="SGD",
                       optimizer_kwargs={"lr": 0.5, "momentum": 0.9}))


@pytest.mark.parametrize("broadcast_buffers", [True, False])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_broadcast_buffers_matches_ddp(ranks, stage, broadcast_buffers):
    """BatchNorm running stats against DDP with the same ``broadcast_buffers`` (``forward_sync_buffers``):
    synced from rank 0 before every training forward, or each rank's own (rank-specific batches)."""
    check(ranks(2).run(cases.parity, stage=stage, model="mlp", batchnorm=True, steps=6,
                       broadcast_buffers=broadcast_buffers))


@pytest.mark.parametrize("stage", [0, 3])
def test_buffers_and_setup_broadcast_coalesced(ranks, stage):
    """One broadcast per bucket (per dtype here), not one per tensor: at setup all parameters and buffers
    (fp32, then the int64 counts), before a training forward the nine buffers; none with the option off."""
    for r in ranks(2).run(broadcast_cases.buffer_broadcasts, stage=stage):
        assert r["setup"] == [("torch.float32", 6 * 5 + 6 + 4 * 6 + 6 * 3 + 3 + 2 * 3 + 4 * 6 + 2 * 3, 0),
                              ("torch.int64", 3, 0)], r
        assert r["forward"] == [("torch.float32", 4 * 6 + 2 * 3, 0), ("torch.int64", 3, 0)], r
    assert all(r["forward"] == [] for r in ranks(2).run(broadcast_cases.buffer_broadcasts, stage=1,
                                                        broadcast_buffers=False))
