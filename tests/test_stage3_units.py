"""Stage 3's units (zerorun/zero/stage3.py, units.py): what the parameters are while a unit computes and at
rest, and the units' all-gathers."""

import pytest

import stage3_cases as cases

pytestmark = pytest.mark.slow


def test_parameters_are_plain_while_their_unit_is_gathered(ranks):
    """Note [Plain while gathered]: inside a unit's forward its parameters are ordinary ``nn.Parameter``s and no
    Python runs per torch operation on them (before: the guard's ``__torch_function__`` ran on every op); at
    rest they are guarded again, and a read between steps is refused naming the way out."""
    for r in ranks(2).run(cases.parameter_classes):
        assert r["inside"] == ["Parameter"], r
        assert r["guard_calls"] == 0, r
        assert r["rest"] == ["ZeroParameter"], r
        assert "gathered_parameters" in r["refused"], r
