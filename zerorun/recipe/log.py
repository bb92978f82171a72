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

    project: Optional[str] = None
    entity: Optional[str] = None
    mode: Optional[Literal["online", "offline", "disabled"]] = None
    tags: list[str] = Field(default_factory=list)


class MlflowSpec(Strict):
    """``tracking_uri`` (default: ``MLFLOW_TRACKING_URI``, else the folder ``<log.dir>/mlruns``) and
    ``experiment`` (default: the recipe's name)."""

    tracking_uri: Optional[str] = None
    experiment: Optional[str] = None


class TensorboardSpec(Strict):
    """``dir``: the event files' folder (default: ``tensorboard`` in the run folder)."""

    dir: Optional[str] = None


class LogSpec(Strict):
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
