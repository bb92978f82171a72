"""Loading a recipe: read the YAML, apply the command-line overrides, validate it against the models
(``model.py``) and resolve it: paths made absolute and checked, cross-field rules (``checks.py``).

Each problem is a :class:`~zerorun.errors.ZerorunError` line naming the file, the YAML line and the field (or
the override that set it)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import yaml
from pydantic import ValidationError

from zerorun.errors import ZerorunError
from zerorun.recipe.checks import check_engine_fields
from zerorun.recipe.log import check_trackers
from zerorun.recipe.model import Recipe
from zerorun.recipe.overrides import apply_overrides, env_numbers_as_text, override_for
from zerorun.recipe.paths import absolute, absolute_pattern, is_file_path, matches_any, not_found_hint
from zerorun.recipe.problems import validation_problems
from zerorun.recipe.text import check_duplicate_keys, line_of, load_yaml, read_text
from zerorun.recipe.training import OptimizerSpec


def load_recipe(path: str, overrides: list[str] | None = None, *, check_optimizer: bool = True,
                check_hf: bool = True) -> Recipe:
    """Read, override, validate and resolve the recipe at ``path``. ``check_optimizer=False``, ``check_hf=False``:
    without the checks that import torch or ``transformers`` (:func:`resolve`).

    Returns:
        A :class:`Recipe` whose module paths are absolute (so it can travel to other nodes as JSON).

    Raises:
        ZerorunError: unreadable file, invalid YAML, unknown keys, wrong types, missing model file, data
            patterns that match nothing, unsupported options; the message names file, line and field. Type and
            field problems are all reported, one line each (:func:`~zerorun.recipe.problems.validation_problems`).
    """
    text = read_text(path, "recipe")
    data, root = load_yaml(text, path)
    check_duplicate_keys(root, path)
    if not isinstance(data, dict):
        raise ZerorunError(f"{path}: a recipe must be a YAML mapping (name:, model:, train:, ...)")
    overrides = overrides or []
    data = apply_overrides(env_numbers_as_text(data, root), overrides)
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as e:  # every problem, one line each (an unknown field first: it explains a missing one)
        raise ZerorunError("\n".join(validation_problems(e.errors(), path, root, overrides, Recipe))) from None
    return resolve(recipe, path, root, overrides, check_optimizer=check_optimizer, check_hf=check_hf)


def _check_optimizer(spec: OptimizerSpec, where) -> None:
    """The engine's own rules (:mod:`zerorun.zero.optimizers`): the class exists, is elementwise (or declared so),
    and takes every key given. ``where(*keys)``: the recipe's file, line and field of ``train.optimizer.<keys>``."""
    from zerorun.zero.optimizers import accepts, check_arguments, resolve_optimizer

    try:
        cls = resolve_optimizer(spec.name, elementwise=spec.elementwise)
    except ValueError as e:
        raise ZerorunError(f"{where('name')}: {e}") from None
    kwargs = spec.kwargs()
    if "weight_decay" not in spec.model_fields_set and not accepts(cls, "weight_decay"):
        kwargs.pop("weight_decay")  # the recipe's default 0.0: Rprop takes none (its recipe always failed here)
    try:
        check_arguments(cls, kwargs)
    except ValueError as e:
        key, message = e.args
        raise ZerorunError(f"{where(key) if key else where()}: {message}") from None


@dataclass
class _Source:
    """Where a recipe's fields come from: the file ``path`` (its YAML ``root``) or one of the ``overrides``;
    a ``loc`` is a field's keys, ``("data", "paths", 0)``."""

    path: str
    root: yaml.Node | None
    overrides: list[str]
    base: str = field(init=False)  # the recipe's folder
    cwd: str = field(init=False, default_factory=os.getcwd)

    def __post_init__(self) -> None:
        self.base = os.path.dirname(os.path.abspath(self.path))

    def where(self, *loc) -> str:
        """``path:line: field`` or ``override 'a.b=1': field``: the head of an error line."""
        source = override_for(loc, self.overrides)
        if source is not None:
            return f"override {source!r}: {'.'.join(map(str, loc))}"
        line = line_of(self.root, loc)
        return f"{self.path}{f':{line}' if line else ''}: {'.'.join(map(str, loc))}"

    def in_file(self, *loc) -> bool:  # Note [Recipe paths] in zerorun/recipe/paths.py
        return override_for(loc, self.overrides) is None

    def base_of(self, *loc) -> str:
        """The folder a relative path at ``loc`` is taken against (Note [Recipe paths])."""
        return self.base if self.in_file(*loc) else self.cwd

    def module_file(self, value: str, *loc) -> str:
        """A module field's value made absolute when it names a file (a dotted module name is kept).

        Raises:
            ZerorunError: the file does not exist.
        """
        if not is_file_path(value):
            return value
        full = absolute(value, self.base_of(*loc))
        if not os.path.isfile(full):
            hint = not_found_hint(value, self.base_of(*loc), self.in_file(*loc))
            raise ZerorunError(f"{self.where(*loc)}: file not found: {value}{hint}")
        return full


def _resolve_model(recipe: Recipe, at: _Source, check_hf: bool) -> None:
    """``model.module`` or ``model.hf`` (one of them), its paths absolute and checked."""
    model = recipe.model
    if (model.module is None) == (model.hf is None):
        raise ZerorunError(f"{at.where('model')}: give model.module (a model module) or model.hf (a Hugging Face "
                           "model), one of them")
    if model.hf is not None:
        from zerorun.hf.recipe import resolve_hf_model

        hf = model.hf
        if hf.pretrained is not None:
            hf.pretrained = absolute(hf.pretrained, at.base_of("model", "hf", "pretrained"))
        if isinstance(hf.config, str):
            hf.config = absolute(hf.config, at.base_of("model", "hf", "config"))
        resolve_hf_model(model, at.base, at.where, deep=check_hf)
    else:
        model.module = at.module_file(model.module, "model", "module")
    if model.hf is None and "task" in model.model_fields_set:
        raise ZerorunError(f"{at.where('model', 'task')}: a model.hf field; a model module's forward defines its "
                           "task")


def _resolve_data(recipe: Recipe, at: _Source, check_hf: bool) -> None:
    """The ``data`` section's fields of its ``kind`` only, its paths absolute and matching files."""
    d = recipe.data
    stray = [f for f in ("path", "tokenizer", "text_field") if f in d.model_fields_set]
    if d.kind != "hf" and stray:
        raise ZerorunError(f"{at.where('data', stray[0])}: a data.kind 'hf' field (kind is {d.kind!r})")
    if d.kind != "module" and d.collate is not None:
        raise ZerorunError(f"{at.where('data', 'collate')}: a data.kind 'module' field (kind is {d.kind!r})")
    if d.kind == "hf":
        from zerorun.hf.recipe import resolve_hf_data

        for name in ("path", "tokenizer"):
            if getattr(d, name) is not None:
                setattr(d, name, absolute(getattr(d, name), at.base_of("data", name)))
        resolve_hf_data(d, at.base, at.where, deep=check_hf)
    elif d.kind == "text":
        if not d.paths:
            raise ZerorunError(f"{at.where('data', 'paths')}: kind 'text' needs at least one path pattern")
        for i, pattern in enumerate(d.paths):
            d.paths[i] = absolute_pattern(pattern, at.base_of("data", "paths", i))
            if not matches_any(d.paths[i]):
                hint = not_found_hint(pattern, at.base_of("data", "paths", i), at.in_file("data", "paths", i))
                raise ZerorunError(f"{at.where('data', 'paths', i)}: pattern matches no files: {pattern}{hint}")
    else:
        if not d.module or not d.factory:
            raise ZerorunError(f"{at.where('data')}: kind 'module' needs data.module and data.factory")
        d.module = at.module_file(d.module, "data", "module")
    if recipe.model.hf is not None:
        from zerorun.hf.recipe import check_vocab

        check_vocab(recipe.model, d, at.where, deep=check_hf)


def _resolve_launch(recipe: Recipe, at: _Source) -> None:
    """``launch.workdir`` absolute and a folder; ``launch.python`` an executable found on ``PATH``."""
    launch = recipe.launch
    if launch.workdir is not None:
        launch.workdir = os.path.abspath(os.path.expanduser(launch.workdir))
        if not os.path.isdir(launch.workdir):
            raise ZerorunError(f"{at.where('launch', 'workdir')}: not a directory: {launch.workdir}")
    if launch.python is not None:
        import shutil

        found = shutil.which(launch.python)
        if found is None:
            raise ZerorunError(f"{at.where('launch', 'python')}: no such executable: {launch.python}")


def _resolve_checkpoint(recipe: Recipe, at: _Source) -> None:
    """``checkpoint.resume`` absolute; ``checkpoint.dir`` absolute (its default when only ``every`` is given)
    and not a file."""
    ckpt = recipe.checkpoint
    if ckpt.resume:  # a checkpoint the recipe reads (zerorun/checkpoint/resume.py checks it before launching)
        ckpt.resume = absolute(ckpt.resume, at.base_of("checkpoint", "resume"))
    if ckpt.every or ckpt.dir:
        ckpt.dir = os.path.abspath(os.path.expanduser(ckpt.dir or os.path.join(recipe.log.dir, recipe.name,
                                                                                "checkpoints")))
        if os.path.exists(ckpt.dir) and not os.path.isdir(ckpt.dir):
            raise ZerorunError(f"{at.where('checkpoint', 'dir')}: not a directory: {ckpt.dir}")


def resolve(recipe: Recipe, path: str, root: yaml.Node | None = None, overrides: list[str] | None = None, *,
            check_optimizer: bool = True, check_hf: bool = True) -> Recipe:
    """Make module paths absolute and check that they and the data exist (see :func:`load_recipe`).
    ``check_optimizer=False`` leaves out the optimizer check, which imports torch (seconds): the launcher's
    model check does it beside the launch (Note [Model check beside the launch] in zerorun/rank/modelcheck.py);
    ``check_hf=False`` the HF checks that import ``transformers`` (Note [HF checks after the header] in
    zerorun/hf/files.py).

    Raises:
        ZerorunError: the first problem found, one line naming the file and line (or override) and the field.
    """
    at = _Source(path, root, overrides or [])
    _resolve_model(recipe, at, check_hf)
    _resolve_data(recipe, at, check_hf)
    _resolve_launch(recipe, at)
    if check_optimizer:
        _check_optimizer(recipe.train.optimizer, lambda *keys: at.where("train", "optimizer", *keys))
    if "loss_scale" in recipe.model_fields_set and recipe.precision != "fp16":
        raise ZerorunError(f"{at.where('loss_scale')}: loss scaling applies to precision fp16 only "
                           f"(precision is {recipe.precision})")
    _resolve_checkpoint(recipe, at)
    check_trackers(recipe.log.trackers, lambda *loc: at.where("log", *loc))
    check_engine_fields(recipe, at.where)
    return recipe
