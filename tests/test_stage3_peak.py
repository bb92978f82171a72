"""Stage 3 holds at most one unit gathered, plus what the prefetch bound allows (issue 21: the root unit with
the embeddings, final norm and head stayed gathered through forward and backward)."""

from __future__ import annotations

import pytest

import peak_cases as cases



@pytest.mark.parametrize("tie,prefetch_bytes", [(True, None), (False, None), (False, 3000), (True, 3000)])
def test_gathered_bytes_are_one_unit_plus_the_prefetch_bound(ranks, tie, prefetch_bytes):
    """The GPT with ``units = [Block]``: embeddings, final norm and head are units of their own; a tied
    weight is stored once (one flat buffer; its training equals DDP's in test_zero_parity.py)."""
    for r in ranks(2).run(cases.gathered_peak, tie=tie, prefetch_bytes=prefetch_bytes):
        assert 0 < r["peak"] <= r["bound"], r
        assert r["tied_buffers"] == (1 if tie else 0)
        assert r["peak"] == r["estimate"], r  # zerorun estimate's stage-3 "gathered" column


@pytest.mark.parametrize("prefetch_bytes", [None, 3000])
def test_root_parameters_are_gathered_for_their_use_only(ranks, prefetch_bytes):
    """Embedding and head registered on the root (the root unit): gathered per use, never beside a block's
    forward or backward beyond the prefetch bound (Note [Root parameters])."""
    for r in ranks(2).run(cases.gathered_peak, tie=False, prefetch_bytes=prefetch_bytes, root_held=True):
        assert 0 < r["peak"] <= r["bound"], r
        assert r["peak"] <= r["estimate"], r  # the estimate counts the root unit as gathered throughout
