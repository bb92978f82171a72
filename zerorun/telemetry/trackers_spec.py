"""What the trackers record: the scalar names of the step and eval events, and a recipe as MLflow's flat
parameters. The recipe's ``log`` section and the trackers' packages are ``zerorun/recipe/log.py``; the
trackers ``trackers.py``."""

from __future__ import annotations

import math
from typing import Any

#: event field -> tracker scalar name, for rank 0's step events (the loss is the job-wide mean, the rates the
#: job's; memory and bytes sent are rank 0's: ``comm_bytes`` over the steps since the previous step event, and of
#: them ``comm_bytes_inter_node`` to other nodes) and eval events. A field that is absent or null in an event is
#: not logged.
STEP_SCALARS = {"loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm",
                "job_samples_per_s": "perf/samples_per_s", "job_tokens_per_s": "perf/tokens_per_s",
                "peak_rss_bytes": "memory/peak_rss_bytes", "cuda_peak_bytes": "memory/peak_device_bytes",
                "comm_wait_s": "comm/wait_s", "comm_bytes": "comm/bytes",
                "comm_bytes_inter_node": "comm/bytes_inter_node"}
EVAL_SCALARS = {"val_loss": "eval/loss"}
#: every scalar name, in the CSV's column order
SCALAR_NAMES = [*STEP_SCALARS.values(), *EVAL_SCALARS.values()]


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
