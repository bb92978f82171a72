"""The run folder's layout: the name of every file a run folder holds (Note [Run folder]).

Note [Run folder]: every job, ``zerorun train``, ``launch`` and each job of ``bench``, writes one folder,
``<log.dir>/<name>/YYYYmmdd-HHMMSS-xxxx`` (``xxxx``: the first four characters of the job id; ``--run-dir`` or a
``zerorun submit`` folder name it instead), holding:

- :data:`RECIPE` ``recipe.yaml``: the resolved recipe, ``launch.env`` values masked (before the job starts);
- :data:`COMMANDS` ``commands.sh``: each node's launch command, runnable as printed (before the job starts);
- :data:`METRICS` ``metrics.jsonl``: every telemetry event but ``progress``, one JSON object a line, appended
  as the ranks send them (the launcher's ``restart`` events too);
- :data:`OUTPUT` ``output.log``: every other line of the ranks and the launcher, prefixed ``[node N]``;
- :data:`JOB` ``job.json``: how the job ended (status, exit code, message, hosts), written when it ends;
- :data:`SLURM_JOB` ``slurm-job.json``: the SLURM job id, in a folder that ``zerorun submit`` made;
- :data:`TRACKERS` ``trackers.json``: the trackers' run identities (also in ``checkpoint.dir``: Note [Tracker
  resume]), :data:`METRICS_CSV` ``metrics.csv`` (the ``csv`` tracker) and :data:`TENSORBOARD` ``tensorboard/``
  (the ``tensorboard`` tracker's event files, unless ``log.tensorboard.dir``), when the recipe asks for them.

Each node's private folder (the resolved recipe as JSON and torchrun's logs) is not in the run folder: its
watcher makes and removes it (Note [Node watcher] in launch/node.py). Torch-free, imports nothing of zerorun:
the launcher, the telemetry readers and ``zerorun bench`` all name the files through this module.
"""

from __future__ import annotations

import os

RECIPE = "recipe.yaml"
COMMANDS = "commands.sh"
METRICS = "metrics.jsonl"
OUTPUT = "output.log"
JOB = "job.json"
SLURM_JOB = "slurm-job.json"
TRACKERS = "trackers.json"
METRICS_CSV = "metrics.csv"
TENSORBOARD = "tensorboard"

#: every name above, in the order a run folder gets them.
NAMES = (RECIPE, COMMANDS, METRICS, OUTPUT, JOB, SLURM_JOB, TRACKERS, METRICS_CSV, TENSORBOARD)

