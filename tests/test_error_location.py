"""Where a rank's one-line error says it was raised (worker.raised_at): the user's own line, not torch's or
zerorun's frame below it (a new user's stage-3 run placed a dtype error of their forward in zerorun's parameter
guard, and at stage 2 in torch's Linear.forward)."""

import pytest
import torch
import torch.nn as nn

from zerorun.rank.worker import raised_at
from zerorun.zero.unit_plan import pick_units


def _raised(fn) -> BaseException:
    with pytest.raises(Exception) as info:
        fn()
    return info.value


def test_an_error_raised_in_torch_below_the_users_code_is_placed_at_the_users_line():
    linear = nn.Linear(4, 4)

    def users_forward():
        return linear(torch.zeros(2, 3, dtype=torch.float64))  # another dtype and width than the Linear's

    frame = raised_at(_raised(users_forward))
    assert (frame.filename, frame.name) == (__file__, "users_forward"), frame


def test_an_error_raised_in_zerorun_is_placed_at_the_line_that_called_it():
    def users_setup():
        return pick_units(nn.Sequential(nn.Linear(2, 2)), ("Nope",))

    frame = raised_at(_raised(users_setup))
    assert (frame.filename, frame.name) == (__file__, "users_setup"), frame


def test_a_library_the_user_calls_counts_as_theirs_but_pythons_own_library_does_not():
    transformers = pytest.importorskip("transformers")  # installed in site-packages, inside Python's own folder
    frame = raised_at(_raised(lambda: transformers.AutoConfig.for_model("no-such-model-type")))
    assert "transformers" in frame.filename, frame
    frame = raised_at(_raised(lambda: __import__("json").loads("{")))
    assert frame.filename == __file__, frame
