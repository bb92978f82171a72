"""The recipe's ``log`` section (:class:`LogSpec`, with the ``log.trackers`` settings) and the check that each
tracker's package is installed. Imports no tracker library (the recipe is read before any of them is needed);
the trackers themselves are ``zerorun/telemetry/trackers.py``."""

from __future__ import annotations

import importlib.util
from typing import Any, Callable, Literal, Optional

from pydantic import Field

from zerorun.errors import ZerorunError
from zerorun.recipe.values import Strict

#: the trackers `log.trackers` may name (zerorun/telemetry/trackers.py)
Tracker = Literal["tensorboard", "wandb", "mlflow", "csv"]

#: tracker -> (the module its library is imported as, the zerorun extra that installs it); csv is the stdlib's.
PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"),
            "mlflow": ("mlflow", "mlflow")}


class WandbSpec(Strict):
    """``wandb.init``'s settings: ``project`` (default: the recipe's name), ``entity``, ``mode`` (``online``,
    ``offline``: files only, ``wandb sync`` later; default: ``WANDB_MODE`` or wandb's own), ``tags``."""

    project: Optional[str] = Field(None, description="the wandb project (unset: the recipe's name)")
    entity: Optional[str] = Field(None, description="the wandb entity (user or team; unset: wandb's default)")
    mode: Optional[Literal["online", "offline", "disabled"]] = Field(
        None, description="offline: files only, wandb sync later (unset: WANDB_MODE, else wandb's own)")
    tags: list[str] = Field(default_factory=list, description="tags of the wandb run")


class MlflowSpec(Strict):
    """``tracking_uri`` (default: ``MLFLOW_TRACKING_URI``, else the folder ``<log.dir>/mlruns``) and
    ``experiment`` (default: the recipe's name)."""

    tracking_uri: Optional[str] = Field(None, description="the MLflow tracking URI (unset: MLFLOW_TRACKING_URI, "
                                        "else the folder <log.dir>/mlruns)")
    experiment: Optional[str] = Field(None, description="the MLflow experiment (unset: the recipe's name)")


class TensorboardSpec(Strict):
    """``dir``: the event files' folder (default: ``tensorboard`` in the run folder)."""

    dir: Optional[str] = Field(None, description="the event files' folder (unset: tensorboard in the run folder)")


class LogSpec(Strict):
    """Emit a step event every ``every`` steps; runs are written under ``dir/<name>/<timestamp>-<job>/``; the step and
    eval events also go to ``trackers`` with their settings (zerorun/telemetry/trackers.py)."""

    every: int = Field(10, gt=0, description="steps between step events (the dashboard's rows, metrics.jsonl)")
    dir: str = Field("runs", description="the folder of run folders: each run writes <dir>/<name>/<timestamp>-<job>/")
    trackers: list[Tracker] = Field(default_factory=list, description="trackers that also get the step and eval "
                                    "events")
    wandb: WandbSpec = Field(default_factory=WandbSpec, description="the wandb tracker's settings")
    mlflow: MlflowSpec = Field(default_factory=MlflowSpec, description="the mlflow tracker's settings")
    tensorboard: TensorboardSpec = Field(default_factory=TensorboardSpec, description="the tensorboard tracker's "
                                         "settings")


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
