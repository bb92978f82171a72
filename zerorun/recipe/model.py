"""The recipe's pydantic models: :class:`Recipe` (a whole training job) and its model, data, launch and
checkpoint sections; the training and ZeRO sections are ``training.py``, the log section ``log.py``. Loading,
overrides and path resolution: ``load.py`` (:func:`~zerorun.recipe.load.load_recipe`)."""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import Field, field_validator
from pydantic_core import PydanticCustomError

from zerorun.recipe.hostfile import EXPECTED, parse_procs
from zerorun.recipe.log import LogSpec
from zerorun.recipe.text import check_env, env_value_text
from zerorun.recipe.training import LossScaleSpec, TrainSpec, ZeroSpec
from zerorun.recipe.values import Strict, finite_values


class HFModelSpec(Strict):
    """A Hugging Face ``transformers`` model from local files (zerorun/hf/model.py): ``pretrained``, a folder
    with ``config.json`` and ``*.safetensors``, or ``config``, a ``config.json`` path or the mapping itself
    (with ``model_type``). Relative paths: Note [Recipe paths] in ``zerorun/recipe/paths.py``."""

    pretrained: str | None = Field(None, description="a local folder with config.json and *.safetensors, loaded "
                                   "with from_pretrained (no download)")
    config: str | dict[str, Any] | None = Field(None, description="a config.json path, or the config mapping itself "
                                                "(with model_type): the model built from it with fresh weights")

    _finite = field_validator("config")(classmethod(finite_values))


#: ``model.compile``'s backend names (``true`` is ``inductor``): torch.compile's own, CPU and GPU alike
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")


class ModelSpec(Strict):
    """``module``: a .py file path (relative to the recipe's folder; an override's to the working directory:
    Note [Recipe paths]) or a dotted module name; ``factory``: a callable in it, ``factory(**kwargs) ->
    torch.nn.Module``. Or ``hf`` (instead of ``module``): a Hugging Face model for ``task`` (``causal-lm``),
    ``kwargs`` passed to ``from_config``/``from_pretrained``. ``compile``: ``torch.compile`` the model with
    that backend (``true``: inductor) at every stage (Note [Compiling per unit] in zerorun/zero/compiling.py)."""

    module: str | None = Field(None, description="the model module: a .py file (relative to the recipe's folder) "
                               "or a dotted module name; give it or model.hf")
    factory: str = Field("build_model", description="the callable in model.module that returns the "
                         "torch.nn.Module: factory(**kwargs)")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="keyword arguments of the factory (model.hf: "
                                   "of from_config/from_pretrained)")
    hf: HFModelSpec | None = Field(None, description="a Hugging Face transformers model from local files, instead "
                                   "of model.module")
    task: Literal["causal-lm"] = Field("causal-lm", description="model.hf only: the head the model is built with "
                                       "(AutoModelForCausalLM)")

    compile: bool | Literal[COMPILE_BACKENDS] = Field(
        False, description="torch.compile the model: true (inductor) or a backend (inductor, aot_eager, eager); "
        "stage 3 compiles each unit's forward, the code between units runs eagerly")

    _finite = field_validator("kwargs")(classmethod(finite_values))

    @field_validator("compile", mode="before")
    @classmethod
    def _compile(cls, value: Any) -> Any:
        if value is None:  # unset
            return False
        if isinstance(value, bool) or value in COMPILE_BACKENDS:
            return value
        raise PydanticCustomError("compile", "expected true, false or a torch.compile backend ({backends}); got "
                                  "{value}", {"backends": ", ".join(COMPILE_BACKENDS), "value": repr(value)})

    def compile_backend(self) -> str | None:
        """``model.compile``'s backend: ``None`` (not compiled), ``"inductor"`` for ``true``, else the name."""
        return "inductor" if self.compile is True else self.compile or None

    def source(self) -> tuple[str, str, dict[str, Any]]:
        """``(module, factory, kwargs)`` that build this model with :func:`zerorun.rank.userload.build_model`; for
        ``hf``: ``zerorun.hf.model.build_model`` with the spec's fields."""
        if self.hf is None:
            return self.module, self.factory, self.kwargs
        spec = {k: v for k, v in self.hf.model_dump().items() if v is not None}
        return "zerorun.hf.model", "build_model", {**self.kwargs, **spec, "task": self.task}


class DataSpec(Strict):
    """``kind: text``: byte-level windows (vocabulary 256) over the files matched by ``paths`` (glob patterns;
    ``{stdlib}`` is the Python standard library's source folder, site-packages and dist-packages excluded,
    files sorted by path); the last ``val_fraction`` of the bytes is the validation split.
    ``kind: module``: ``factory(**kwargs)`` in ``module`` returns ``(train_dataset, val_dataset_or_None)``.
    ``kind: hf``: ``path`` tokenized with ``tokenizer`` into ``seq_len`` blocks (zerorun/hf/data.py)."""

    kind: Literal["text", "module", "hf"] = Field("text", description="text: byte-level windows over files; "
                                                  "module: your datasets from data.factory; hf: a tokenized file")
    paths: list[str] = Field(default_factory=list, description="kind text: glob patterns of the files read "
                             "({stdlib}: the Python standard library's sources; ** recursive), sorted by path")
    # kind hf (zerorun/hf/data.py): a .jsonl/.parquet/.txt file or a datasets.save_to_disk folder, the record
    # field holding the text, and the tokenizer's folder (byte-level, vocabulary 256, when absent)
    path: str | None = Field(None, description="kind hf: a .jsonl, .parquet or .txt file or a "
                             "datasets.save_to_disk folder")
    text_field: str = Field("text", description="kind hf: the record field that holds the text")
    tokenizer: str | None = Field(None, description="kind hf: the tokenizer's local folder (unset: byte-level, "
                                  "vocabulary 256)")
    seq_len: int = Field(128, gt=0, description="tokens per sample (kinds text and hf; bytes for text)")
    val_fraction: float = Field(0.01, ge=0.0, lt=1.0, description="the fraction of the data, taken from its end, "
                                "kept as the validation split (kinds text and hf)")
    module: str | None = Field(None, description="kind module: a .py file (relative to the recipe's folder) or a "
                               "dotted module name")
    factory: str | None = Field(None, description="kind module: the callable in data.module that returns a "
                                "Dataset or a (train, val) pair: factory(**kwargs)")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="kind module: keyword arguments of "
                                   "data.factory")
    collate: str | None = Field(None, description="kind module: the function in data.module that makes a "
                                "micro-batch of a list of samples (a DataLoader's collate_fn, e.g. padding); "
                                "unset: torch's default_collate, which stacks samples of one shape")

    _finite = field_validator("kwargs")(classmethod(finite_values))


class LaunchSpec(Strict):
    """Ranks per node without a hostfile: a number, or ``auto`` (the default: one per visible GPU, else 1),
    ``gpu`` or ``cpu`` (Note [Ranks per node] in zerorun/launch/slots.py); Python interpreter and working
    directory on the nodes; extra environment variables for every rank (POSIX names; values as given, never
    :data:`MASK`); seconds a collective may wait for a silent peer before the job fails (a hung rank ends the
    job instead of hanging it)."""

    procs_per_node: int | Literal["auto", "gpu", "cpu"] = Field(
        "auto", description="ranks per node without a hostfile: a count from 1 to 4096, gpu (one per visible GPU), "
        "cpu (one per CPU) or auto (one per visible GPU, else 1)")
    python: str | None = Field(None, description="the Python interpreter the ranks run on every node (unset: the "
                               "one running zerorun)")
    workdir: str | None = Field(None, description="the folder the ranks run in on every node (unset: the working "
                                "directory)")
    env: dict[str, str] = Field(default_factory=dict, description="extra environment variables of every rank "
                                "(POSIX names; values as text, masked in the run folder's copy)")
    collective_timeout_s: float = Field(600.0, gt=0, description="seconds a collective may wait for a silent peer "
                                        "before the job fails instead of hanging")
    # a failed job is started again from its latest checkpoint up to this many times; a restart continues without
    # lost hosts while at least min_nodes remain (None: all must); Note [Job restarts] in launch/restart.py
    max_restarts: int = Field(0, ge=0, description="times a failed job is started again from its newest "
                              "checkpoint (zerorun train --max-restarts)")
    min_nodes: Optional[int] = Field(None, gt=0, description="a restart continues without lost hosts while at "
                                     "least this many remain (unset: all must)")

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


class CheckpointSpec(Strict):
    """Sharded checkpoints (``zerorun/checkpoint.py``): saved every ``every`` steps (0: only at the end) and
    at the end into ``dir`` (default when only ``every`` is given: ``<log.dir>/<name>/checkpoints``; no
    checkpoints when neither is set), keeping the ``keep`` most recent. ``resume``: the checkpoint folder to
    resume from, set by ``zerorun train --resume`` (Note [Resume lookup] in ``zerorun/checkpoint/resume.py``); one written
    in the recipe is relative to its folder and checked as ``--resume PATH``."""

    dir: str | None = Field(None, description="the checkpoints' folder (unset with checkpoint.every set: "
                            "<log.dir>/<name>/checkpoints; neither set: no checkpoints)")
    every: int = Field(0, ge=0, description="steps between checkpoints (0: only at the end)")
    keep: int = Field(2, gt=0, description="the most recent checkpoints kept; older ones are deleted")
    resume: str | None = Field(None, description="a checkpoint folder to resume from (as zerorun train --resume "
                               "PATH; relative to the recipe's folder)")


class Recipe(Strict):
    """A whole training job. See DESIGN.md's recipe section and ``recipes/gpt-stdlib.yaml``."""

    name: str = Field(min_length=1, description="the job's name: its run folders are <log.dir>/<name>/ (a folder "
                      "name, no '/')")
    model: ModelSpec = Field(description="the model: a model module and factory, or a Hugging Face model")
    data: DataSpec = Field(default_factory=DataSpec, description="the training and validation data")
    train: TrainSpec = Field(description="steps, batch sizes, optimizer, schedule, evaluation")
    zero: ZeroSpec = Field(default_factory=ZeroSpec, description="the ZeRO stage and its knobs, mixed precision "
                           "and offload")
    precision: Literal["fp32", "bf16", "fp16"] = Field("fp32", description="the dtype of parameters, gradients "
                                                        "and collectives (2-byte ones keep fp32 master weights)")
    loss_scale: LossScaleSpec = Field(default_factory=LossScaleSpec, description="dynamic loss scaling "
                                      "(precision fp16 only)")
    #: ``zero``: zerorun's ZeRO runtime; ``ddp``/``fsdp2``: torch's DistributedDataParallel or FSDP2
    #: (``fully_shard`` on stage 3's units), the baselines of ``zerorun bench`` (zerorun/bench/baselines.py).
    runtime: Literal["zero", "ddp", "fsdp2"] = Field("zero", description="zero: zerorun's ZeRO runtime; ddp or "
                                                      "fsdp2: torch's DDP or FSDP2, the baselines of zerorun bench")
    launch: LaunchSpec = Field(default_factory=LaunchSpec, description="ranks per node, interpreter, working "
                               "folder, environment, timeouts, restarts")
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec, description="sharded checkpoints: where, "
                                       "how often, how many, resume")
    log: LogSpec = Field(default_factory=LogSpec, description="step events, run folders and trackers")

    @field_validator("name")
    @classmethod
    def _name_is_a_folder_name(cls, v: str) -> str:
        if "/" in v or v in (".", ".."):
            raise ValueError("must be usable as a folder name (no '/')")
        return v
