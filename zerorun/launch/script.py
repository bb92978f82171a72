"""What a job runs: a recipe (``zerorun train``) or a user's own :class:`Script` (``zerorun launch``), and the
parts of it that planning needs (:func:`job_parts`)."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Script:
    """A user's own program for ``zerorun launch``: ``target`` is a script path (or, with ``module``, a dotted
    module run as ``python -m``), ``args`` its arguments; runs go to ``log_dir/<name>/<time>/``."""

    target: str
    args: tuple[str, ...] = ()
    module: bool = False
    log_dir: str = "runs"

    @property
    def name(self) -> str:
        """The run's name: the script's file name without ``.py``, or the module's last part."""
        return self.target.rsplit(".", 1)[-1] if self.module else os.path.splitext(os.path.basename(self.target))[0]

    def program(self) -> list[str]:
        """What torchrun runs on every rank: zerorun's script worker around the script or module."""
        return ["-m", "zerorun.rank.script_worker", *(["-m"] if self.module else []), self.target, *self.args]


def job_parts(job) -> tuple[str | None, list[str], list[str] | None, dict]:
    """(recipe JSON, modules the ranks import, program, recipe's launch fields: ``python``, ``workdir``,
    ``env``) of a :class:`~zerorun.recipe.Recipe` or a :class:`Script`; the program is None for a recipe
    (``python -m zerorun.rank.worker``, plan.build_plan)."""
    if isinstance(job, Script):
        return None, [job.target], job.program(), {}  # preflight looks for a file or a dotted module
    modules = [job.model.source()[0]] + ([job.data.module] if job.data.kind == "module" else [])
    launch = {"python": job.launch.python, "workdir": job.launch.workdir, "env": job.launch.env}
    return job.model_dump_json(), modules, None, launch
