"""Collectives are issued in program order: the same sequence on every rank whatever the timing (Note [Testing
program order] in program_order_cases.py). The same spawned runs check that every tensor of a collective is on
the group's device (tests/collective_devices.py), at every stage."""

import pytest

import program_order_cases as cases

COMBOS = [(stage, precision) for stage in (0, 1, 2, 3) for precision in ("fp32", "bf16")]
_RUNS: dict = {}


def _sequences(ranks) -> list:
    """Every rank's sequences for every combo: one spawned run for the whole module."""
    if "per_rank" not in _RUNS:
        _RUNS["per_rank"] = ranks(2).run(cases.sequences, combos=COMBOS)
    return _RUNS["per_rank"]


def _same_on_every_rank(per_rank: list, stage: int) -> None:
    for precision in ("fp32", "bf16"):
        key = f"{stage}/{precision}"
        first, other = per_rank[0][key], per_rank[1][key]
        assert len(first) > 20, (key, len(first))  # several steps (stage 0 bf16: 26), not trivial
        diff = next((i for i, (a, b) in enumerate(zip(first, other)) if a != b), min(len(first), len(other)))
        assert first == other, (f"stage {stage} {precision}: collective #{diff + 1} differs: rank 0 issued "
                                f"{first[diff:diff + 3]}, rank 1 {other[diff:diff + 3]}")
        assert len({g for _, g, _, _ in first}) == 1, f"{key}: more than one process group"


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_every_rank_issues_the_same_collectives(ranks, stage):
    _same_on_every_rank(_sequences(ranks), stage)


@pytest.mark.slow
def test_stage3_every_rank_issues_the_same_collectives(ranks):
    _same_on_every_rank(_sequences(ranks), 3)
