"""``zerorun submit recipe.yaml --nodes N``: a batch job that runs ``zerorun train`` in a SLURM allocation.

Note [Submitted job]: submit makes the run folder first (``<log.dir>/<name>/<time>-xxxx``, as ``zerorun train``
names it) and writes into it the resolved ``recipe.yaml`` and ``submit.sbatch``: a commented bash script whose
``#SBATCH`` lines ask for the nodes and whose body runs ``zerorun train RECIPE --launcher slurm --run-dir
"$RUN_DIR" ...`` with the same Python, from the folder submit ran in (so relative paths mean what they meant
there), writing into that same folder: its ``metrics.jsonl`` is where submit said. The script is submitted with
``sbatch --parsable``; the job id goes into ``slurm-job.json`` beside it and into the user's job records
(launch/slurm_jobs.py), for ``zerorun attach JOBID``. The script stays readable and editable: ``sbatch
RUN_DIR/submit.sbatch`` submits it again.

``#SBATCH`` lines are read by sbatch, not by a shell: a value with a space, ``"`` or ``\\`` is written in
double quotes with ``\\"`` and ``\\\\`` (sbatch 22.05 reads them so; no ``$VAR`` is expanded there), and a
``%`` of a path given to ``--output`` is doubled (sbatch's file name patterns). The body quotes for bash
(``shlex.quote``). Extra sbatch arguments (after ``--``) become ``#SBATCH`` lines after zerorun's, so they win
where they repeat an option (sbatch keeps the last).
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field

from zerorun.errors import ZerorunError
from zerorun.launch.slurm_jobs import one_line, remember

SCRIPT_NAME = "submit.sbatch"
_SBATCH_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class SubmitOptions:
    """What ``zerorun submit`` asks of SLURM: ``nodes``, ``procs_per_node`` (ranks per node; None: the recipe's
    ``launch.procs_per_node``), ``time`` (sbatch's ``--time``, e.g. ``01:00:00``), ``partition``, ``account``,
    ``job_name`` (default: the recipe's name), ``sbatch_args`` (more sbatch arguments, as given after
    ``--``) and ``resume`` (``zerorun train``'s ``--resume``: ``"latest"`` or a checkpoint path; None: none)."""

    nodes: int = 1
    procs_per_node: int | None = None
    time: str | None = None
    partition: str | None = None
    account: str | None = None
    job_name: str | None = None
    sbatch_args: tuple[str, ...] = field(default_factory=tuple)
    resume: str | None = None


def directive_value(value: str) -> str:
    """``value`` as an ``#SBATCH`` line holds it: plain when it has no space, quote or backslash, else in double
    quotes with ``"`` and ``\\`` escaped.

    Raises:
        ZerorunError: a line break in ``value`` (no ``#SBATCH`` line can hold it).
    """
    if "\n" in value or "\r" in value:
        raise ZerorunError(f"{value!r}: a line break cannot go into an #SBATCH line")
    if value and not any(c.isspace() or c in '"\\\'' for c in value):
        return value
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def group_args(args: list[str] | tuple[str, ...]) -> list[list[str]]:
    """Extra sbatch arguments grouped into options: each ``-x``/``--long`` with the words after it that do not
    start with ``-`` (``['-C', 'volta', '--qos=high']`` -> ``[['-C', 'volta'], ['--qos=high']]``).

    Raises:
        ZerorunError: a first word that is not an option (sbatch's arguments after ``--`` are options only: the
            script is zerorun's).
    """
    groups: list[list[str]] = []
    for arg in args:
        if arg.startswith("-") and arg != "-":
            groups.append([arg])
        elif groups:
            groups[-1].append(arg)
        else:
            raise ZerorunError(f"sbatch argument {arg!r}: expected an option (-x or --name) after '--'")
    return groups


def train_argv(recipe_path: str, overrides: list[str], procs_per_node: int, python: str,
               resume: str | None = None) -> list[str]:
    """The job's command (before ``--run-dir``): zerorun train of the recipe (absolute path), with the slurm
    launcher, ``procs_per_node`` ranks per node and the plain progress lines (a batch job has no terminal),
    then ``--resume`` (``latest``: bare, the latest checkpoint or step 0; else that path, made absolute)."""
    again = [] if resume is None else ["--resume"] if resume == "latest" else [f"--resume={os.path.abspath(resume)}"]
    return [python, "-m", "zerorun", "train", os.path.abspath(recipe_path), "--launcher", "slurm",
            "--num-procs", str(procs_per_node), "--no-dashboard", *again, *overrides]


def _comment(text: str) -> str:
    """``text`` on one comment line: a line break in it (an override's value) would end the comment."""
    return text.replace("\r", "\\r").replace("\n", "\\n")


def render_script(*, recipe, recipe_path: str, overrides: list[str], options: SubmitOptions, run_dir: str,
                  workdir: str, python: str | None = None, command: list[str] | None = None) -> str:
    """The text of ``submit.sbatch`` (Note [Submitted job]).

    Args:
        recipe: the loaded :class:`~zerorun.recipe.Recipe` (its name, stage, precision, procs_per_node).
        recipe_path / overrides: as given to ``zerorun submit`` (the script repeats them to ``zerorun train``).
        options: the sbatch options. run_dir: the run folder (absolute). workdir: where the job starts.
        python: the interpreter that runs zerorun in the job (default: this one).
        command: the ``zerorun submit`` command line, for the script's header comment.

    Raises:
        ZerorunError: a value that no ``#SBATCH`` line can hold, or extra sbatch arguments that are not options.
    """
    procs = options.procs_per_node or recipe.launch.procs_per_node
    python = python or sys.executable
    q = shlex.quote
    lines = [
        "#!/bin/bash",
        _comment(f"# zerorun submit: {recipe.name} on {options.nodes} node{'s' * (options.nodes != 1)} x {procs} "
                 f"rank{'s' * (procs != 1)}, ZeRO stage {recipe.zero.stage}, {recipe.precision}"),
        _comment(f"# written {time.strftime('%Y-%m-%d %H:%M:%S %Z')}"
                 + (f" by: {shlex.join(command)}" if command else "")),
        "#",
        "# Submit it again (edit it first if you like):  sbatch " + q(os.path.join(run_dir, SCRIPT_NAME)),
        "# Follow the job:                               zerorun attach JOBID   (or: zerorun show " + q(run_dir) + ")",
        "#",
        "# The job runs `zerorun train` once in its allocation: zerorun starts one torchrun agent per node with srun",
        "# (--launcher slurm; the first node is the rendezvous host) and --num-procs ranks on each. Every event goes",
        "# to RUN_DIR/metrics.jsonl, every line of the ranks to RUN_DIR/output.log, zerorun's own progress to",
        "# RUN_DIR/slurm-JOBID.out. A job submitted again appends to the same run folder (set RUN_DIR and --output",
        "# to another folder to keep runs apart). With --resume (zerorun submit --resume) a job submitted again, or",
        "# requeued, continues from the latest checkpoint of checkpoint.dir (SLURM's time limit saves one).",
        f"#SBATCH --job-name={directive_value(options.job_name or recipe.name)}",
        f"#SBATCH --nodes={options.nodes}",
        f"#SBATCH --ntasks-per-node={procs}",
    ]
    for flag, value in (("time", options.time), ("partition", options.partition), ("account", options.account)):
        if value is not None:
            lines.append(f"#SBATCH --{flag}={directive_value(value)}")
    output = os.path.join(run_dir.replace("%", "%%"), "slurm-%j.out")  # %j: sbatch puts the job id there
    lines.append(f"#SBATCH --output={directive_value(output)}")
    groups = group_args(options.sbatch_args)
    if groups:
        lines.append("# given after '--' to zerorun submit (later lines win where an option repeats):")
        lines += ["#SBATCH " + " ".join(directive_value(w) for w in g) for g in groups]
    argv = train_argv(recipe_path, overrides, procs, python, options.resume)
    cut = options.resume is not None  # --resume goes on the options' line
    lines += [
        "",
        "# where the job writes (the same folder as --output above)",
        f"RUN_DIR={q(run_dir)}",
        "# where zerorun submit ran: relative paths of the overrides and of log.dir / checkpoint.dir start here",
        f"cd {q(workdir)} || exit 1",
        "# the Python that ran zerorun submit: every node must see it at this path (a shared file system)",
        "exec " + shlex.join(argv[:5]) + " \\",
        "    " + shlex.join(argv[5:10 + cut]) + ' --run-dir "$RUN_DIR"' + (" \\" if argv[10 + cut:] else ""),
    ]
    if argv[10 + cut:]:
        lines.append("    " + shlex.join(argv[10 + cut:]))
    return "\n".join(lines) + "\n"


def submit(recipe_path: str, overrides: list[str], options: SubmitOptions, *, dry_run: bool = False,
           command: list[str] | None = None, out=None) -> tuple[str | None, str]:
    """Make the run folder, write ``recipe.yaml`` and ``submit.sbatch`` into it and submit the script with
    ``sbatch --parsable`` (Note [Submitted job]); with ``dry_run`` print the script and stop there.

    Returns:
        ``(job id, run folder)``; the job id is None with ``dry_run``.

    Raises:
        ZerorunError (exit code 2): a bad recipe or override (one line each, as ``zerorun train``), no sbatch on
            PATH, sbatch refusing the job (its stderr in one line), a folder that cannot be written.
    """
    from zerorun.launch.run import new_run_dir
    from zerorun.recipe import load_recipe, masked_yaml

    out = out or sys.stdout
    for item in overrides:  # the script repeats the overrides: launch.env's values would be written into it
        if item.split("=", 1)[0].strip().startswith("launch.env"):
            raise ZerorunError(f"override {item.split('=', 1)[0]!r}: its values would be written into the batch "
                               "script; set launch.env in the recipe or in an environment file (.zerorun_env)")
    recipe = load_recipe(recipe_path, overrides, check_optimizer=False)
    if options.resume not in (None, "latest") and not os.path.exists(options.resume):
        raise ZerorunError(f"--resume {options.resume}: no such checkpoint")
    if options.procs_per_node is None and recipe.launch.procs_per_node < 1:
        raise ZerorunError("launch.procs_per_node: must be at least 1")
    sbatch = None if dry_run else shutil.which("sbatch")
    if not dry_run and sbatch is None:
        raise ZerorunError("sbatch: not found on PATH (zerorun submit needs SLURM's client commands; "
                           "--dry-run writes the script without them)")
    run_dir = os.path.abspath(new_run_dir(recipe.log.dir, recipe.name, uuid.uuid4().hex))
    text = render_script(recipe=recipe, recipe_path=recipe_path, overrides=overrides, options=options,
                         run_dir=run_dir, workdir=os.getcwd(), command=command)
    script = os.path.join(run_dir, SCRIPT_NAME)
    try:
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, "recipe.yaml"), "w", encoding="utf-8") as f:
            f.write(masked_yaml(recipe))
        with open(script, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(script, 0o755)
    except OSError as e:
        raise ZerorunError(f"log.dir: cannot write the run folder {run_dir}: {e.strerror}") from None
    if dry_run:
        out.write(text)
        out.write(f"# zerorun: wrote {script}; submit it with: sbatch {shlex.quote(script)}\n")
        out.flush()
        return None, run_dir
    try:
        done = subprocess.run([sbatch, "--parsable", script], capture_output=True, text=True,
                              timeout=_SBATCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise ZerorunError(f"sbatch: no answer in {_SBATCH_TIMEOUT_S:.0f} s (is slurmctld up?); "
                           f"script: {script}") from None
    job_id = done.stdout.strip().split(";")[0] if done.returncode == 0 else ""
    if not job_id:
        raise ZerorunError(f"sbatch refused the job: {one_line(done.stderr or done.stdout)} (script: {script})")
    remember(job_id, run_dir, in_run_dir=True)
    out.write(f"zerorun: submitted job {job_id}: {recipe.name} on {options.nodes} node"
              f"{'s' * (options.nodes != 1)}; run dir {run_dir}\n"
              f"zerorun: follow it with: zerorun attach {job_id}\n")
    out.flush()
    return job_id, run_dir
