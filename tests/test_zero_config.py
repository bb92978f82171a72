"""ZeroConfig (the library's configuration): a value of the wrong type or range is one line naming the field, at
construction, before any engine or collective (before: a TypeError from a comparison, or accepted and wrong)."""

import math

import pytest
import torch

from zerorun.zero import ZeroConfig
from zerorun.zero.optimizers import optimizer_class


@pytest.mark.parametrize("kwargs,message", [
    ({"bucket_mb": "25"}, "zero.bucket_mb must be a number > 0, got '25'"),  # before: TypeError '<=' str and int
    ({"bucket_mb": math.inf}, "zero.bucket_mb must be a number > 0, got inf"),
    ({"offload_buffer_mb": 0}, "zero.offload_buffer_mb must be a number > 0, got 0"),
    ({"grad_accum_steps": "2"}, "zero.grad_accum_steps must be an integer >= 1, got '2'"),
    ({"grad_accum_steps": 2.5}, "zero.grad_accum_steps must be an integer >= 1, got 2.5"),  # before: never stepped
    ({"persistence_threshold": -1}, "zero.persistence_threshold must be an integer >= 0, got -1"),
    ({"grad_clip": -1.0}, "zero.grad_clip must be a number >= 0 (0: no clipping) or unset, got -1.0"),  # flipped
    ({"grad_clip": math.nan}, "zero.grad_clip must be a number >= 0 (0: no clipping) or unset, got nan"),  # NaN
    ({"stage": "2"}, "zero.stage must be 0, 1, 2 or 3, got '2'"),  # before: "got 2", as if 2 were wrong
    ({"stage": True}, "zero.stage must be 0, 1, 2 or 3, got True"),
    ({"prefetch": 1}, "zero.prefetch must be true or false, got 1"),
    ({"units": 5}, "zero.units must be a list of module class names or qualified names, got 5"),
    ({"units": ("Block", 3)}, "zero.units must be a list of module class names or qualified names, got ('Block', 3)"),
])
def test_a_wrong_value_is_one_line_naming_the_field(kwargs, message):
    with pytest.raises(ValueError) as e:
        ZeroConfig(**kwargs)
    assert str(e.value) == message


def test_units_may_be_one_name_or_a_list():
    """``units="Linear"`` was read as its letters ("no module of class L, a, e, i, n, r")."""
    assert ZeroConfig(stage=3, units="Linear").units == ("Linear",)
    assert ZeroConfig(stage=3, units=["Block", "head"]).units == ("Block", "head")
    assert ZeroConfig(grad_clip=0).grad_clip == 0 and ZeroConfig(bucket_mb=1).bucket_mb == 1


def test_an_optimizer_instance_is_one_line_saying_what_to_pass():
    """DeepSpeed's ``initialize(model, optimizer=opt)`` habit: the message was the instance's 16-line repr."""
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1e-3)
    with pytest.raises(ValueError) as e:
        optimizer_class(opt)
    assert str(e.value) == ("optimizer: got an instance of AdamW; the engine makes the optimizer over its flat "
                            "slices: pass its class or name and its options, e.g. optimizer='AdamW', "
                            "optimizer_kwargs={'lr': ...} (or param_groups)")


def test_a_model_that_is_not_a_module_is_one_line():
    """Before: ``AttributeError: 'function' object has no attribute 'named_parameters'``."""
    from zerorun.zero import initialize

    with pytest.raises(ValueError) as e:
        initialize(lambda x: x)
    assert str(e.value) == "model: expected a torch.nn.Module, got function"
