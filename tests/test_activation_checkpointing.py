"""``activation_checkpointing`` at stage 3 trains as stage 0 without it (Note [Recomputed as first run] in
zerorun/zero/recompute.py): buffers a unit's forward changes are changed once, and the recomputation sees them
as the first run did."""

import pytest

import checkpointing_cases as cases
from zerorun.zero import ZeroConfig


def _rel(a, b) -> float:
    return max(float((a[k].double() - b[k].double()).abs().max() / b[k].double().abs().max().clamp_min(1e-12))
               for k in b)


@pytest.mark.parametrize("kind,accum,forwards", [("bn", 1, 1), ("bn", 2, 2), ("gate", 1, 1), ("gate", 1, 2),
                                                 ("count", 2, 1), ("dropout", 1, 2)])
def test_checkpointed_units_train_and_keep_their_buffers_as_stage_0(ranks, kind, accum, forwards):
    """At bf2f9b1 BatchNorm's running statistics were updated twice per step (``num_batches_tracked`` 6 after 3
    steps), and a gate halved in place after its use gave other gradients from the first step (1.968701 against
    stage 0's 1.963740 in a review)."""
    pool = ranks(2)
    ref = pool.run(cases.train, stage=0, kind=kind, accum=accum, forwards=forwards)
    got = pool.run(cases.train, stage=3, kind=kind, accum=accum, forwards=forwards)
    for rank, (r, g) in enumerate(zip(ref, got)):
        assert max(abs(a - b) / abs(a) for a, b in zip(r["losses"], g["losses"])) <= 1e-5, (rank, r["losses"],
                                                                                            g["losses"])
        assert _rel(g["state"], r["state"]) <= 1e-5, rank
        assert sorted(g["buffers"]) == sorted(r["buffers"]) and _rel(g["buffers"], r["buffers"]) <= 1e-5, rank


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_activation_checkpointing_below_stage_3_is_refused(stage):
    """It was silently ignored below stage 3 (the same config trained other numbers at stage 3); the recipe
    refused it already."""
    with pytest.raises(ValueError, match=f"^activation_checkpointing recomputes each stage-3 unit's forward in "
                                         f"backward; this is stage {stage}: set zero.stage 3"):
        ZeroConfig(stage=stage, activation_checkpointing=True)
