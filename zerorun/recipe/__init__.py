"""The YAML recipe (``recipes/gpt-stdlib.yaml``) and the hostfile: what a user writes to describe a job.

- ``model.py``, ``training.py``, ``log.py``: the pydantic models, one field of the recipe each (every field's
  meaning is its ``description``: ``docs/reference/recipe-fields.md``, written by ``python -m
  zerorun.recipe.reference``);
- ``load.py``: :func:`load_recipe` (read, override, validate) and :func:`resolve` (paths, cross-field checks,
  ``checks.py``); ``text.py`` (YAML, lines, ``launch.env``), ``overrides.py``, ``values.py`` (validators),
  ``problems.py`` (one line per problem), ``paths.py`` (Note [Recipe paths]);
- ``hostfile.py``: DeepSpeed's hostfile format and the ``--include``/``--exclude`` selection.

Each problem is a :class:`~zerorun.errors.ZerorunError` line naming the file, the YAML line and the field.
This package re-exports the names the module ``zerorun.recipe`` offered; its modules import each other
directly, never through this file.
"""

from zerorun.recipe.load import load_recipe, resolve
from zerorun.recipe.log import LogSpec
from zerorun.recipe.model import CheckpointSpec, DataSpec, HFModelSpec, LaunchSpec, ModelSpec, Recipe
from zerorun.recipe.overrides import apply_overrides, env_numbers_as_text
from zerorun.recipe.paths import (absolute, absolute_pattern, expand_data_paths, is_file_path, matches_any,
                                  not_found_hint, stdlib_dir)
from zerorun.recipe.problems import validation_problems
from zerorun.recipe.text import (ENV_NAME, MASK, MAX_ENV_STRING, MAX_YAML_NODES, check_env, env_string_bytes,
                                 env_value_text, load_yaml, masked, masked_yaml, read_text)
from zerorun.recipe.training import LossScaleSpec, OptimizerSpec, ScheduleSpec, TrainSpec, ZeroSpec
from zerorun.recipe.values import finite_values, optimizer_argument

__all__ = [
    "CheckpointSpec", "DataSpec", "ENV_NAME", "HFModelSpec", "LaunchSpec", "LogSpec", "LossScaleSpec", "MASK",
    "MAX_ENV_STRING", "MAX_YAML_NODES", "ModelSpec", "OptimizerSpec", "Recipe", "ScheduleSpec", "TrainSpec",
    "ZeroSpec", "absolute", "absolute_pattern", "apply_overrides", "check_env", "env_numbers_as_text",
    "env_string_bytes", "env_value_text", "expand_data_paths", "finite_values", "is_file_path", "load_recipe",
    "load_yaml", "masked", "masked_yaml", "matches_any", "not_found_hint", "optimizer_argument", "read_text",
    "resolve", "stdlib_dir", "validation_problems",
]
