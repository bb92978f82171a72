"""The ``zerorun`` command line (typer), one module per group of commands: jobs.py (train, launch), batch.py
(submit, attach: SLURM), tools.py (estimate, bench, show, consolidate, import-deepspeed, env), options.py (the
options they share), app.py (the typer app), entry.py (``main``, the console entry point), env.py (``zerorun
env``'s report)."""

from zerorun.cli.app import app
from zerorun.cli.batch import attach, submit
from zerorun.cli.entry import main, optional_value, split_sbatch_args
from zerorun.cli.jobs import launch, train
from zerorun.cli.options import MAX_PREFLIGHT_S
from zerorun.cli.tools import bench, consolidate, env_report, estimate, import_deepspeed, show

__all__ = ["MAX_PREFLIGHT_S", "app", "attach", "bench", "consolidate", "env_report", "estimate", "import_deepspeed",
           "launch", "main", "optional_value", "show", "split_sbatch_args", "submit", "train"]
