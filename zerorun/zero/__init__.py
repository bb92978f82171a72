"""zerorun's ZeRO runtime, usable as a library without the CLI: ``zerorun.zero.initialize(model, ...)``."""

from zerorun.zero.deferred import deferred_init, is_deferred, materialize, place_on
from zerorun.zero.engine import ZeroConfig, ZeroEngine, default_param_groups, initialize, resolve_optimizer
from zerorun.zero.precision import LossScaleConfig
from zerorun.zero.stage3_access import register_external_parameter

__all__ = ["LossScaleConfig", "ZeroConfig", "ZeroEngine", "default_param_groups", "deferred_init", "initialize",
           "is_deferred", "materialize", "place_on", "register_external_parameter", "resolve_optimizer"]
