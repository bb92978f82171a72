"""The YAML recipe: pydantic models, dotted command-line overrides, path resolution.

A recipe names model, data, training, ZeRO stage, precision, launch and logging (``recipes/gpt-stdlib.yaml``).
Each problem is a :class:`~zerorun.errors.ZerorunError` line naming the file, the YAML line and the field. The
recipe's text (YAML, overrides, error lines) is ``recipe_text.py``; its paths ``recipe_paths.py``."""

from __future__ import annotations

import os
from typing import Annotated, Any, Literal, Optional

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_core import PydanticCustomError

from zerorun.errors import ZerorunError
from zerorun.hostfile import EXPECTED, parse_procs
from zerorun.recipe_checks import check_engine_fields
from zerorun.recipe_paths import (absolute, absolute_pattern, expand_data_paths, is_file_path, matches_any,  # noqa: F401
                                  not_found_hint, stdlib_dir)
from zerorun.recipe_text import (ENV_NAME, MASK, MAX_ENV_STRING, MAX_YAML_NODES, apply_overrides,  # noqa: F401
                                 check_env, env_numbers_as_text, env_string_bytes, env_value_text, load_yaml,
                                 masked, masked_yaml, read_text)
from zerorun.recipe_text import check_duplicate_keys as _check_duplicate_keys
from zerorun.recipe_text import line_of as _line_of
from zerorun.recipe_text import finite_values, optimizer_argument
from zerorun.recipe_text import override_for as _override_for
from zerorun.recipe_text import refuse_bool as _refuse_bool
from zerorun.recipe_text import validation_problems
from zerorun.telemetry.trackers_spec import LogSpec, check_trackers  # the log section


class _Strict(BaseModel):
    # allow_inf_nan=False: YAML's .inf/.nan would pass and then reach the ranks as null through JSON
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    _no_bool_numbers = field_validator("*", mode="before")(classmethod(_refuse_bool))


class HFModelSpec(_Strict):
    """A Hugging Face ``transformers`` model from local files (zerorun/hf/model.py): ``pretrained``, a folder
    with ``config.json`` and ``*.safetensors``, or ``config``, a ``config.json`` path or the mapping itself
    (with ``model_type``). Relative paths: Note [Recipe paths] in ``zerorun/recipe_paths.py``."""

    pretrained: str | None = None
    config: str | dict[str, Any] | None = None

    _finite = field_validator("config")(classmethod(finite_values))


class ModelSpec(_Strict):
    """``module``: a .py file path (relative to the recipe's folder; an override's to the working directory:
    Note [Recipe paths]) or a dotted module name; ``factory``: a callable in it, ``factory(**kwargs) ->
    torch.nn.Module``. Or ``hf`` (instead of ``module``): a Hugging Face model for ``task`` (``causal-lm``),
    ``kwargs`` passed to ``from_config``/``from_pretrained``."""

    module: str | None = None
    factory: str = "build_model"
    kwargs: dict[str, Any] = Field(default_factory=dict)
    hf: HFModelSpec | None = None
    task: Literal["causal-lm"] = "causal-lm"

    _finite = field_validator("kwargs")(classmethod(finite_values))

    def source(self) -> tuple[str, str, dict[str, Any]]:
        """``(module, factory, kwargs)`` that build this model with :func:`zerorun.rank.userload.build_model`; for
        ``hf``: ``zerorun.hf.model.build_model`` with the spec's fields."""
        if self.hf is None:
            return self.module, self.factory, self.kwargs
        spec = {k: v for k, v in self.hf.model_dump().items() if v is not None}
        return "zerorun.hf.model", "build_model", {**self.kwargs, **spec, "task": self.task}


class DataSpec(_Strict):
    """``kind: text``: byte-level windows (vocabulary 256) over the files matched by ``paths`` (glob patterns;
    ``{stdlib}`` is the Python standard library's source folder, site-packages and dist-packages excluded,
    files sorted by path); the last ``val_fraction`` of the bytes is the validation split.
    ``kind: module``: ``factory(**kwargs)`` in ``module`` returns ``(train_dataset, val_dataset_or_None)``.
    ``kind: hf``: ``path`` tokenized with ``tokenizer`` into ``seq_len`` blocks (zerorun/hf/data.py)."""

    kind: Literal["text", "module", "hf"] = "text"
    paths: list[str] = Field(default_factory=list)
    # kind hf (zerorun/hf/data.py): a .jsonl/.parquet/.txt file or a datasets.save_to_disk folder, the record
    # field holding the text, and the tokenizer's folder (byte-level, vocabulary 256, when absent)
    path: str | None = None
    text_field: str = "text"
    tokenizer: str | None = None
    seq_len: int = Field(128, gt=0)
    val_fraction: float = Field(0.01, ge=0.0, lt=1.0)
    module: str | None = None
    factory: str | None = None
    kwargs: dict[str, Any] = Field(default_factory=dict)

    _finite = field_validator("kwargs")(classmethod(finite_values))


class OptimizerSpec(BaseModel):
    """``name``: a ``torch.optim`` class; every other key is passed to it (``lr``, ``betas``, ...).
    ``weight_decay`` applies to tensors of 2 or more dimensions only unless ``decay_1d: true``. ``elementwise:
    true`` declares a class outside zerorun's checked list elementwise (Note [Elementwise optimizers] in
    ``zero/optimizers.py``)."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    # every other key, checked one by one (each problem on its own line, at the key's line)
    __pydantic_extra__: dict[str, Annotated[Any, AfterValidator(optimizer_argument)]]
    _no_bool_numbers = field_validator("*", mode="before")(classmethod(_refuse_bool))
    name: str = "AdamW"
    lr: float = Field(3e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    decay_1d: bool = False
    elementwise: bool = False

    def kwargs(self) -> dict[str, Any]:
        """Keyword arguments for the optimizer class, ``weight_decay`` included (split into groups later)."""
        return {k: v for k, v in self.model_dump().items() if k not in ("name", "decay_1d", "elementwise")}


class ScheduleSpec(_Strict):
    """Learning-rate multiplier: linear warm-up over ``warmup_steps``, then ``cosine``/``linear`` decay to
    ``min_lr_ratio`` at the last step, or ``constant``."""

    warmup_steps: int = Field(0, ge=0)
    decay: Literal["cosine", "linear", "constant"] = "cosine"
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0)


class TrainSpec(_Strict):
    """Optimizer steps, per-rank micro-batch size (samples), gradient accumulation steps, clipping, seed and
    evaluation cadence (``eval_every`` steps, 0 for never; ``eval_batches`` micro-batches per rank)."""

    steps: int = Field(gt=0)
    micro_batch_size: int = Field(gt=0)
    grad_accum_steps: int = Field(1, gt=0)
    optimizer: OptimizerSpec = Field(default_factory=OptimizerSpec)
    schedule: ScheduleSpec = Field(default_factory=ScheduleSpec)
    grad_clip: float | None = Field(None, ge=0)
    seed: int = 1234
    eval_every: int = Field(0, ge=0)
    eval_batches: int = Field(8, gt=0)
    activation_checkpointing: bool = False


class ZeroSpec(_Strict):
    """ZeRO stage (0 = DDP-equivalent), bucket size in MiB; stage 3: units (module class names gathered and
    freed as one; empty: chosen by parameter count), prefetch of the next unit (or of the units within
    ``prefetch_bytes``), and whether the model is
    built on the meta device so that no rank ever holds all of it (``meta_init``)."""

    stage: Literal[0, 1, 2, 3] = 0
    bucket_mb: float = Field(25.0, gt=0)
    units: list[str] = Field(default_factory=list)
    prefetch: bool = True
    # Stage 3: the most bytes of units all-gathered ahead of the one in use (unset: the next unit; 0: none).
    prefetch_bytes: int | None = Field(None, ge=0)
    meta_init: bool = True
    # Stage 3: parameters of at most this many elements stay whole on every rank (0: none).
    persistence_threshold: int = Field(0, ge=0)
    # Mixed precision and offload (zerorun/zero/precision.py, offload.py): reduce gradients in fp32 instead of
    # the 2-byte precision; where the fp32 master slices and optimizer states live (none | cpu | disk), the
    # folder for disk's swap files and the host buffer (MiB) they are paged through.
    reduce_dtype: Literal["fp32"] | None = None
    offload_optimizer: Literal["none", "cpu", "disk"] = "none"
    offload_params: Literal["none", "disk"] = "none"  # stage 3: parameter slices in a file (param_offload.py)
    offload_path: str | None = None
    offload_buffer_mb: float = Field(64.0, gt=0)
    # Dtype in which micro-step gradients are summed (DeepSpeed's name): None = fp32 when
    # train.grad_accum_steps > 1 and precision is bf16/fp16, else the parameters' dtype (ZeroConfig).
    grad_accum_dtype: Optional[Literal["fp32", "bf16", "fp16"]] = None
    # Copy rank 0's module buffers (BatchNorm statistics) to every rank before each training forward (DDP's
    # broadcast_buffers; zerorun/zero/config.py). false: each rank keeps its own.
    broadcast_buffers: bool = True


class LossScaleSpec(_Strict):
    """fp16 dynamic loss scaling (Note [Loss scaling] in zerorun/zero/precision.py): the first scale, good
    steps before it grows by ``growth_factor``, the factor applied on overflow, and its floor."""

    initial_scale: float = Field(65536.0, gt=0)
    growth_interval: int = Field(2000, gt=0)
    backoff: float = Field(0.5, gt=0, lt=1)
    min_scale: float = Field(1.0, gt=0)
    growth_factor: float = Field(2.0, gt=1)


class LaunchSpec(_Strict):
    """Ranks per node without a hostfile: a number, or ``auto`` (the default: one per visible GPU, else 1),
    ``gpu`` or ``cpu`` (Note [Ranks per node] in zerorun/launch/slots.py); Python interpreter and working
    directory on the nodes; extra environment variables for every rank (POSIX names; values as given, never
    :data:`MASK`); seconds a collective may wait for a silent peer before the job fails (a hung rank ends the
    job instead of hanging it)."""

    procs_per_node: int | Literal["auto", "gpu", "cpu"] = "auto"
    python: str | None = None
    workdir: str | None = None
    env: dict[str, str] = Field(default_factory=dict)
    collective_timeout_s: float = Field(600.0, gt=0)
    # a failed job is started again from its latest checkpoint up to this many times; a restart continues without
    # lost hosts while at least min_nodes remain (None: all must); Note [Job restarts] in launch/restart.py
    max_restarts: int = Field(0, ge=0)
    min_nodes: Optional[int] = Field(None, gt=0)

    _env_value_text = field_validator("env", mode="before")(classmethod(lambda cls, env: env_value_text(env)))

    @field_validator("procs_per_node", mode="before")
    @classmethod
    def _procs(cls, value: Any) -> Any:
        try:
            if isinstance(value, bool) or not isinstance(value, (int, str)):
                raise ValueError(value)
            return parse_procs(value, "launch.procs_per_node")
        except ValueError:
            shown = f"a boolean ({str(value).lower()})" if isinstance(value, bool) else repr(value)
            raise PydanticCustomError("procs_per_node", "{expected}; got {value}",
                                      {"expected": EXPECTED, "value": shown}) from None

    _env_names_and_values = field_validator("env")(classmethod(lambda cls, env: check_env(env)))


class CheckpointSpec(_Strict):
    """Sharded checkpoints (``zerorun/checkpoint.py``): saved every ``every`` steps (0: only at the end) and
    at the end into ``dir`` (default when only ``every`` is given: ``<log.dir>/<name>/checkpoints``; no
    checkpoints when neither is set), keeping the ``keep`` most recent. ``resume``: the checkpoint folder to
    resume from, set by ``zerorun train --resume`` (Note [Resume lookup] in ``zerorun/resume.py``); one written
    in the recipe is relative to its folder and checked as ``--resume PATH``."""

    dir: str | None = None
    every: int = Field(0, ge=0)
    keep: int = Field(2, gt=0)
    resume: str | None = None


class Recipe(_Strict):
    """A whole training job. See DESIGN.md's recipe section and ``recipes/gpt-stdlib.yaml``."""

    name: str = Field(min_length=1)
    model: ModelSpec
    data: DataSpec = Field(default_factory=DataSpec)
    train: TrainSpec
    zero: ZeroSpec = Field(default_factory=ZeroSpec)
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    loss_scale: LossScaleSpec = Field(default_factory=LossScaleSpec)
    #: ``zero``: zerorun's ZeRO runtime; ``ddp``/``fsdp2``: torch's DistributedDataParallel or FSDP2
    #: (``fully_shard`` on stage 3's units), the baselines of ``zerorun bench`` (zerorun/baselines.py).
    runtime: Literal["zero", "ddp", "fsdp2"] = "zero"
    launch: LaunchSpec = Field(default_factory=LaunchSpec)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    log: LogSpec = Field(default_factory=LogSpec)

    @field_validator("name")
    @classmethod
    def _name_is_a_folder_name(cls, v: str) -> str:
        if "/" in v or v in (".", ".."):
            raise ValueError("must be usable as a folder name (no '/')")
        return v


# --------------------------------------------------------------------------------------------- loading
def load_recipe(path: str, overrides: list[str] | None = None, *, check_optimizer: bool = True,
                check_hf: bool = True) -> Recipe:
    """Read, override, validate and resolve the recipe at ``path``. ``check_optimizer=False``, ``check_hf=False``:
    without the checks that import torch or ``transformers`` (:func:`resolve`).

    Returns:
        A :class:`Recipe` whose module paths are absolute (so it can travel to other nodes as JSON).

    Raises:
        ZerorunError: unreadable file, invalid YAML, unknown keys, wrong types, missing model file, data
            patterns that match nothing, unsupported options; the message names file, line and field. Type and
            field problems are all reported, one line each (:func:`~zerorun.recipe_text.validation_problems`).
    """
    text = read_text(path, "recipe")
    data, root = load_yaml(text, path)
    _check_duplicate_keys(root, path)
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


def resolve(recipe: Recipe, path: str, root: yaml.Node | None = None, overrides: list[str] | None = None, *,
            check_optimizer: bool = True, check_hf: bool = True) -> Recipe:
    """Make module paths absolute and check that they and the data exist (see :func:`load_recipe`).
    ``check_optimizer=False`` leaves out the optimizer check, which imports torch (seconds): the launcher's
    model check does it beside the launch (Note [Model check beside the launch] in zerorun/modelcheck.py);
    ``check_hf=False`` the HF checks that import ``transformers`` (Note [HF checks after the header] in
    zerorun/hf/files.py)."""
    base = os.path.dirname(os.path.abspath(path))
    cwd = os.getcwd()

    def where(*loc) -> str:
        source = _override_for(loc, overrides or [])
        if source is not None:
            return f"override {source!r}: {'.'.join(map(str, loc))}"
        line = _line_of(root, loc)
        return f"{path}{f':{line}' if line else ''}: {'.'.join(map(str, loc))}"

    def in_file(*loc) -> bool:  # Note [Recipe paths] in zerorun/recipe_paths.py
        return _override_for(loc, overrides or []) is None

    def base_of(*loc) -> str:
        return base if in_file(*loc) else cwd

    def module_file(value: str, *loc) -> str:
        if not is_file_path(value):
            return value  # a dotted module name
        full = absolute(value, base_of(*loc))
        if not os.path.isfile(full):
            hint = not_found_hint(value, base_of(*loc), in_file(*loc))
            raise ZerorunError(f"{where(*loc)}: file not found: {value}{hint}")
        return full

    if (recipe.model.module is None) == (recipe.model.hf is None):
        raise ZerorunError(f"{where('model')}: give model.module (a model module) or model.hf (a Hugging Face "
                           "model), one of them")
    if recipe.model.hf is not None:
        from zerorun.hf.recipe import resolve_hf_model

        hf = recipe.model.hf
        if hf.pretrained is not None:
            hf.pretrained = absolute(hf.pretrained, base_of("model", "hf", "pretrained"))
        if isinstance(hf.config, str):
            hf.config = absolute(hf.config, base_of("model", "hf", "config"))
        resolve_hf_model(recipe.model, base, where, deep=check_hf)
    else:
        recipe.model.module = module_file(recipe.model.module, "model", "module")
    if recipe.model.hf is None and "task" in recipe.model.model_fields_set:
        raise ZerorunError(f"{where('model', 'task')}: a model.hf field; a model module's forward defines its task")
    d = recipe.data
    stray = [f for f in ("path", "tokenizer", "text_field") if f in d.model_fields_set]
    if d.kind != "hf" and stray:
        raise ZerorunError(f"{where('data', stray[0])}: a data.kind 'hf' field (kind is {d.kind!r})")
    if d.kind == "hf":
        from zerorun.hf.recipe import resolve_hf_data

        for field in ("path", "tokenizer"):
            if getattr(d, field) is not None:
                setattr(d, field, absolute(getattr(d, field), base_of("data", field)))
        resolve_hf_data(d, base, where, deep=check_hf)
    elif d.kind == "text":
        if not d.paths:
            raise ZerorunError(f"{where('data', 'paths')}: kind 'text' needs at least one path pattern")
        for i, pattern in enumerate(d.paths):
            d.paths[i] = absolute_pattern(pattern, base_of("data", "paths", i))
            if not matches_any(d.paths[i]):
                hint = not_found_hint(pattern, base_of("data", "paths", i), in_file("data", "paths", i))
                raise ZerorunError(f"{where('data', 'paths', i)}: pattern matches no files: {pattern}{hint}")
    else:
        if not d.module or not d.factory:
            raise ZerorunError(f"{where('data')}: kind 'module' needs data.module and data.factory")
        d.module = module_file(d.module, "data", "module")
    if recipe.model.hf is not None:
        from zerorun.hf.recipe import check_vocab

        check_vocab(recipe.model, d, where)
    launch = recipe.launch
    if launch.workdir is not None:
        launch.workdir = os.path.abspath(os.path.expanduser(launch.workdir))
        if not os.path.isdir(launch.workdir):
            raise ZerorunError(f"{where('launch', 'workdir')}: not a directory: {launch.workdir}")
    if launch.python is not None:
        import shutil

        found = shutil.which(launch.python)
        if found is None:
            raise ZerorunError(f"{where('launch', 'python')}: no such executable: {launch.python}")
    if check_optimizer:
        _check_optimizer(recipe.train.optimizer, lambda *keys: where("train", "optimizer", *keys))
    if "loss_scale" in recipe.model_fields_set and recipe.precision != "fp16":
        raise ZerorunError(f"{where('loss_scale')}: loss scaling applies to precision fp16 only "
                           f"(precision is {recipe.precision})")
    ckpt = recipe.checkpoint
    if ckpt.resume:  # a checkpoint the recipe reads (zerorun/resume.py checks it before launching)
        ckpt.resume = absolute(ckpt.resume, base_of("checkpoint", "resume"))
    if ckpt.every or ckpt.dir:
        ckpt.dir = os.path.abspath(os.path.expanduser(ckpt.dir or os.path.join(recipe.log.dir, recipe.name,
                                                                                "checkpoints")))
        if os.path.exists(ckpt.dir) and not os.path.isdir(ckpt.dir):
            raise ZerorunError(f"{where('checkpoint', 'dir')}: not a directory: {ckpt.dir}")
    check_trackers(recipe.log.trackers, lambda *loc: where("log", *loc))
    check_engine_fields(recipe, where)
    return recipe
