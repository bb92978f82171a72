"""Where a rank's one-line error says it was raised (userload.raised_at): the user's own line, not torch's or
zerorun's frame below it (a new user's stage-3 run placed a dtype error of their forward in zerorun's parameter
guard, and at stage 2 in torch's Linear.forward)."""

import os
import pytest
import torch
import torch.nn as nn

import zerorun.zero.build
from zerorun.rank.userload import raised_at
from zerorun.rank.worker import one_line_warning
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


def test_a_ranks_warning_is_one_line_naming_the_users_place_only():
    """Before: Python's two lines, the second a source line of torch's (``result = torch_func_method(...)``) for
    stage 3's warnings, raised on behalf of a torch operation."""
    inside = one_line_warning(UserWarning("stage 3: parameter 'w' is used outside its unit"), UserWarning,
                              torch.overrides.__file__, 1794)
    assert inside == "UserWarning: stage 3: parameter 'w' is used outside its unit\n"
    assert one_line_warning("kept", UserWarning, zerorun.zero.build.__file__, 64) == "UserWarning: kept\n"
    assert one_line_warning("old API", FutureWarning, __file__, 7) == f"FutureWarning: old API (at {__file__}:7)\n"



def test_the_base_interpreters_libraries_count_as_the_users_in_a_venv(monkeypatch):
    """A new user's review: in a venv made with --system-site-packages the test above failed: the base interpreter's
    site-packages lies inside its standard library's folder, which the venv's own paths (its purelib) do not name,
    so transformers' frames counted as Python's own and an error was placed in the wrong frame."""
    import sysconfig

    from zerorun.rank.userload import below_the_user

    real = sysconfig.get_paths

    def venv_paths(*args, **kwargs):
        paths = dict(real(*args, **kwargs))
        if not kwargs.get("vars"):
            paths["purelib"] = paths["platlib"] = "/tmp/some-venv/lib/python3/site-packages"
        return paths

    monkeypatch.setattr(sysconfig, "get_paths", venv_paths)
    stdlib = real()["stdlib"]
    assert not below_the_user(os.path.join(stdlib, "site-packages", "transformers", "configuration_utils.py"))
    assert not below_the_user(os.path.join(stdlib, "dist-packages", "yaml", "parser.py"))
    assert below_the_user(os.path.join(stdlib, "json", "decoder.py"))
