"""The launcher: plan a job, start its nodes (locally, over SSH, or with srun in a SLURM allocation), supervise
them, and return how it ended.

The public API is :func:`run_job` (``zerorun train``, ``launch`` and ``bench`` all call it) with
:func:`select` and :func:`ssh_options` (the hosts: launch/hosts.py), :func:`dry_run` (launch/dryrun.py),
:class:`Script` (launch/script.py), the :class:`Outcome` of a job (launch/outcome.py), and
:func:`choose_launcher` with the :class:`Launcher` it returns (launch/launcher.py). Importing this package
does not import torch.
"""

from zerorun.launch.launcher import Launcher, choose_launcher  # noqa: F401
from zerorun.launch.outcome import Outcome  # noqa: F401
from zerorun.launch.dryrun import dry_run  # noqa: F401
from zerorun.launch.hosts import select, ssh_options  # noqa: F401
from zerorun.launch.run import run_job  # noqa: F401
from zerorun.launch.script import Script  # noqa: F401
