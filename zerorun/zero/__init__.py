"""zerorun's ZeRO runtime, usable as a library without the CLI: ``zerorun.zero.initialize(model, ...)``.

The names below are imported when first used (PEP 562), so that a torch-free module of this package
(``paging_math``) can be imported by the launcher without importing torch."""

import importlib

_EXPORTS = {
    "deferred_init": "zerorun.zero.deferred", "is_deferred": "zerorun.zero.deferred",
    "materialize": "zerorun.zero.deferred", "place_on": "zerorun.zero.deferred",
    "ZeroConfig": "zerorun.zero.engine", "ZeroEngine": "zerorun.zero.engine",
    "default_param_groups": "zerorun.zero.engine", "initialize": "zerorun.zero.build",
    "resolve_optimizer": "zerorun.zero.engine", "LossScaleConfig": "zerorun.zero.precision",
    "register_external_parameter": "zerorun.zero.stage3_access",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'zerorun.zero' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
