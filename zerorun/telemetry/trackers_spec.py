"""The recipe's ``log`` section (:class:`LogSpec`, with the ``log.trackers`` settings) and what the trackers
record: the scalar names of the step and eval events, each tracker's package and the extra that installs it.
Imports no tracker library (the recipe is read before any of them is needed); the trackers are ``trackers.py``."""

from __future__ import annotations

import importlib.util
import math
from typing import Any, Callable, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator

from zerorun.errors import ZerorunError
from zerorun.recipe_text import refuse_bool

Tracker = Literal["tensorboard", "wandb", "mlflow", "csv"]

#: tracker -> (the module its library is imported as, the zerorun extra that installs it); csv is the stdlib's.
PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"),
            "mlflow": ("mlflow", "mlflow")}

#: event field -> tracker scalar name, for rank 0's step events (the loss is the job-wide mean, the rates the
#: job's; memory is rank 0's) and eval events. A field that is absent or null in an event is not logged.
STEP_SCALARS = {"loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm",
                "job_samples_per_s": "perf/samples_per_s", "job_tokens_per_s": "perf/tokens_per_s",
                "peak_rss_bytes": "memory/peak_rss_bytes", "cuda_peak_bytes": "memory/peak_device_bytes",
                "comm_wait_s": "comm/wait_s"}
EVAL_SCALARS = {"val_loss": "eval/loss"}
#: every scalar name, in the CSV's column order
SCALAR_NAMES = [*STEP_SCALARS.values(), *EVAL_SCALARS.values()]


class _Strict(BaseModel):  # as recipe.py's
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    _no_bool_numbers = field_validator("*", mode="before")(classmethod(refuse_bool))


class WandbSpec(_Strict):
    """``wandb.init``'s settings: ``project`` (default: the recipe's name), ``entity``, ``mode`` (``online``,
    ``offline``: files only, ``wandb sync`` later; default: ``WANDB_MODE`` or wandb's own), ``tags``."""

    project: Optional[str] = None
    entity: Optional[str] = None
    mode: Optional[Literal["online", "offline", "disabled"]] = None
    tags: list[str] = Field(default_factory=list)


class MlflowSpec(_Strict):
    """``tracking_uri`` (default: ``MLFLOW_TRACKING_URI``, else the folder ``<log.dir>/mlruns``) and
    ``experiment`` (default: the recipe's name)."""

    tracking_uri: Optional[str] = None
    experiment: Optional[str] = None


class TensorboardSpec(_Strict):
    """``dir``: the event files' folder (default: ``tensorboard`` in the run folder)."""

    dir: Optional[str] = None


class LogSpec(_Strict):
    """Emit a step event every ``every`` steps; runs are written under ``dir/<name>/<timestamp>/``; the step and
    eval events also go to ``trackers`` with their settings (zerorun/telemetry/trackers.py)."""

    every: int = Field(10, gt=0)
    dir: str = "runs"
    trackers: list[Tracker] = Field(default_factory=list)
    wandb: WandbSpec = Field(default_factory=WandbSpec)
    mlflow: MlflowSpec = Field(default_factory=MlflowSpec)
    tensorboard: TensorboardSpec = Field(default_factory=TensorboardSpec)


def check_trackers(trackers: list[str], where: Callable[..., str],
                   find: Callable[[str], Any] = importlib.util.find_spec) -> None:
    """Each tracker of ``trackers`` once, and its library installed (looked up, not imported: seconds for
    torch.utils.tensorboard). ``where(*loc)``: the recipe's file, line and field of ``log.<loc>``.

    Raises:
        ZerorunError: a tracker named twice, or one whose package is missing (naming the extra to install).
    """
    for i, name in enumerate(trackers):
        if name in trackers[:i]:
            raise ZerorunError(f"{where('trackers', i)}: {name!r} is named twice")
        module, extra = PACKAGES.get(name, (None, None))
        try:
            found = module is None or find(module) is not None
        except (ImportError, ValueError):  # a module hidden as None in sys.modules, a broken parent
            found = False
        if not found:
            raise ZerorunError(f"{where('trackers', i)}: the {name} tracker needs the {module} package: "
                               f"pip install 'zerorun[{extra}]'")


def scalars(kind: str, data: dict[str, Any]) -> dict[str, float]:
    """The tracker scalars (name -> value) of a ``step`` or ``eval`` event's fields ``data``: the numbers of
    :data:`STEP_SCALARS` / :data:`EVAL_SCALARS` that are finite; ``{}`` for any other kind."""
    names = STEP_SCALARS if kind == "step" else EVAL_SCALARS if kind == "eval" else {}
    out = {}
    for key, name in names.items():
        value = data.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out[name] = float(value)
    return out


def flat_params(data: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """A (masked) recipe's mapping as dotted keys -> text (MLflow's parameters): ``{"train.steps": "30"}``;
    lists as JSON text."""
    import json

    out: dict[str, str] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flat_params(value, name + "."))
        else:
            out[name] = value if isinstance(value, str) else json.dumps(value)
    return out
