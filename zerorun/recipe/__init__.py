"""The YAML recipe (``recipes/gpt-stdlib.yaml``) and the hostfile: what a user writes to describe a job.

- ``model.py``, ``training.py``, ``log.py``: the pydantic models, one field of the recipe each (every field's
  meaning is its ``description``: ``docs/reference/recipe-fields.md``, written by ``python -m
  zerorun.recipe.reference``);
- ``load.py``: :func:`load_recipe` (read, override, validate) and :func:`resolve` (paths, cross-field checks,
  ``checks.py``); ``text.py`` (YAML, lines, ``launch.env``), ``overrides.py``, ``values.py`` (validators),
  ``problems.py`` (one line per problem), ``paths.py`` (Note [Recipe paths]);
- ``hostfile.py``: DeepSpeed's hostfile format and the ``--include``/``--exclude`` selection.

Each problem is a :class:`~zerorun.errors.ZerorunError` line naming the file, the YAML line and the field.
This package re-exports the names the module ``zerorun.recipe`` offered, imported when first used (PEP 562,
as ``zerorun/zero/__init__.py``): the launcher's ``from zerorun.recipe.hostfile import Host`` then costs no
pydantic models (a second at every command's start). Its modules import each other directly, never through
this file.
"""

import importlib

_EXPORTS = {
    "load_recipe": "zerorun.recipe.load", "resolve": "zerorun.recipe.load",
    "LogSpec": "zerorun.recipe.log",
    "CheckpointSpec": "zerorun.recipe.model", "DataSpec": "zerorun.recipe.model",
    "HFModelSpec": "zerorun.recipe.model", "LaunchSpec": "zerorun.recipe.model",
    "ModelSpec": "zerorun.recipe.model", "Recipe": "zerorun.recipe.model",
    "apply_overrides": "zerorun.recipe.overrides", "env_numbers_as_text": "zerorun.recipe.overrides",
    "absolute": "zerorun.recipe.paths", "absolute_pattern": "zerorun.recipe.paths",
    "expand_data_paths": "zerorun.recipe.paths", "is_file_path": "zerorun.recipe.paths",
    "matches_any": "zerorun.recipe.paths", "not_found_hint": "zerorun.recipe.paths",
    "stdlib_dir": "zerorun.recipe.paths",
    "validation_problems": "zerorun.recipe.problems",
    "ENV_NAME": "zerorun.recipe.text", "MASK": "zerorun.recipe.text", "MAX_ENV_STRING": "zerorun.recipe.text",
    "MAX_YAML_NODES": "zerorun.recipe.text", "check_env": "zerorun.recipe.text",
    "env_string_bytes": "zerorun.recipe.text", "env_value_text": "zerorun.recipe.text",
    "load_yaml": "zerorun.recipe.text", "masked": "zerorun.recipe.text", "masked_yaml": "zerorun.recipe.text",
    "read_text": "zerorun.recipe.text",
    "LossScaleSpec": "zerorun.recipe.training", "OptimizerSpec": "zerorun.recipe.training",
    "ScheduleSpec": "zerorun.recipe.training", "TrainSpec": "zerorun.recipe.training",
    "ZeroSpec": "zerorun.recipe.training",
    "finite_values": "zerorun.recipe.values", "optimizer_argument": "zerorun.recipe.values",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'zerorun.recipe' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
