"""``zerorun submit recipe.yaml --nodes N``: a batch job that runs ``zerorun train`` in a SLURM allocation.

Note [Submitted job]: submit makes the run folder first (``<log.dir>/<name>/<time>-xxxx``, as ``zerorun train``
names it) and writes into it the resolved ``recipe.yaml`` and ``submit.sbatch``: a commented bash script whose
``#SBATCH`` lines ask for the nodes and whose body runs ``zerorun train RECIPE --launcher slurm --run-dir
"$RUN_DIR" ...`` with the same Python, from the folder submit ran in (so relative paths mean what they meant
there), writing into that same folder: its ``metrics.jsonl`` is where submit said. The script is submitted with
``sbatch --parsable``; the job id goes into ``slurm-job.json`` beside it and into the user's job records
(slurm/jobs.py), for ``zerorun attach JOBID``. The script stays readable and editable: ``sbatch
RUN_DIR/submit.sbatch`` submits it again.

``#SBATCH`` lines are read by sbatch, not by a shell: a value with a space, ``"`` or ``\\`` is written in
double quotes with ``\\"`` and ``\\\\`` (sbatch 22.05 reads them so; no ``$VAR`` is expanded there), and a
``%`` of a path given to ``--output`` is doubled (sbatch's file name patterns). The body quotes for bash
(``shlex.quote``). Extra sbatch arguments (after ``--``) become ``#SBATCH`` lines after zerorun's, so they win
where they repeat an option (sbatch keeps the last).
"""

from __future__ import annotations

import itertools
import os
import shlex
import shutil
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field

from zerorun import runfolder
from zerorun.errors import ZerorunError
from zerorun.slurm.jobs import one_line, remember
from zerorun.slurm.sbatch import check_partition_size, gpus_asked, ranks_per_node, refuse_array, signal_directive

SCRIPT_NAME = "submit.sbatch"
_SBATCH_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class SubmitOptions:
    """What ``zerorun submit`` asks of SLURM: ``nodes``, ``procs_per_node`` (ranks per node; None: the recipe's
    ``launch.procs_per_node``), ``time`` (sbatch's ``--time``, e.g. ``01:00:00``), ``partition``, ``account``,
    ``job_name`` (default: the recipe's name), ``sbatch_args`` (more sbatch arguments, as given after
    ``--``), ``resume`` (``zerorun train``'s ``--resume``: ``"latest"`` or a checkpoint path; None: none),
    ``gpus_per_node`` (GPUs to ask for on each node; None: those of ``sbatch_args``, or none) and ``save_before``
    (seconds before the time limit at which the ranks save and stop, Note [Early save signal]; 0: none)."""

    nodes: int = 1
    procs_per_node: int | None = None
    time: str | None = None
    partition: str | None = None
    account: str | None = None
    job_name: str | None = None
    sbatch_args: tuple[str, ...] = field(default_factory=tuple)
    resume: str | None = None
    gpus_per_node: int | None = None
    save_before: int = 120


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


def misplaced_option(argv: list[str], option: str) -> str:
    """The one line for an option that ``zerorun submit`` does not know (``--qos high`` before ``--``): an
    sbatch option goes after ``--``, as written here with its value(s)."""
    name = option.split("=", 1)[0]
    words = []
    for i, arg in enumerate(argv):
        if arg == "--":
            break
        if arg.split("=", 1)[0] == name:
            words = [arg] + list(itertools.takewhile(lambda w: not w.startswith("-") and "=" not in w,
                                                     argv[i + 1:i + 2]))
            break
    return (f"{name}: not an option of zerorun submit; an sbatch option goes after '--', at the end: zerorun "
            f"submit RECIPE [FIELD=VALUE ...] [options] -- {shlex.join(words or [name])}")


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
        ZerorunError: a value that no ``#SBATCH`` line can hold, extra sbatch arguments that are not options or
            ask for a job array, GPU and rank counts that disagree (Note [Ranks of a submitted job]), a time
            limit within the early save signal (Note [Early save signal]).
    """
    groups = group_args(options.sbatch_args)
    refuse_array(groups)
    gpus = gpus_asked(groups, options.gpus_per_node)
    procs, _ = ranks_per_node(options.procs_per_node, gpus, recipe)
    early = signal_directive(options.save_before, bool(recipe.checkpoint.dir), options.time)
    lines = _header(recipe, options, run_dir, procs, command) + _directives(recipe, options, run_dir, procs, early)
    if groups:
        lines.append("# given after '--' to zerorun submit (later lines win where an option repeats):")
        lines += ["#SBATCH " + " ".join(directive_value(w) for w in g) for g in groups]
    script = os.path.join(run_dir, SCRIPT_NAME)
    again = f"sbatch {script}" if options.resume is not None else resubmit_command(
        command or ["zerorun", "submit", recipe_path, *overrides])
    argv = train_argv(recipe_path, overrides, procs, python or sys.executable, options.resume)
    requeue = options.resume is None and recipe.runtime == "zero"  # the baselines save no checkpoints
    return "\n".join(lines + _body(argv, run_dir, workdir, options.resume is not None, again, requeue)) + "\n"


def resubmit_command(command: list[str]) -> str:
    """``command`` (a ``zerorun submit`` command line) as the one that continues its stopped job: without
    ``--dry-run``, with ``--resume`` before the sbatch arguments."""
    words = [w for w in command if w != "--dry-run"]
    cut = words.index("--") if "--" in words else len(words)
    return shlex.join(words[:cut] + ["--resume"] + words[cut:])


def _header(recipe, options: SubmitOptions, run_dir: str, procs: int, command: list[str] | None) -> list[str]:
    """The script's comment lines: what it runs, when and by which command, how to resubmit and follow it."""
    q = shlex.quote
    return [
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
        "# to another folder to keep runs apart). A requeued job continues from the latest checkpoint of",
        "# checkpoint.dir (SLURM's time limit saves one); with --resume (zerorun submit --resume) a job submitted",
        "# again does too.",
    ]


def _directives(recipe, options: SubmitOptions, run_dir: str, procs: int, early: str | None) -> list[str]:
    """zerorun's ``#SBATCH`` lines: job name, nodes, ranks (and GPUs) per node, time, partition, account, the
    output file (appended to by a requeued job's next run) and the early save signal."""
    lines = [f"#SBATCH --job-name={directive_value(options.job_name or recipe.name)}",
             f"#SBATCH --nodes={options.nodes}",
             f"#SBATCH --ntasks-per-node={procs}"]
    if options.gpus_per_node is not None:
        lines.append(f"#SBATCH --gpus-per-node={options.gpus_per_node}")
    for flag, value in (("time", options.time), ("partition", options.partition), ("account", options.account)):
        if value is not None:
            lines.append(f"#SBATCH --{flag}={directive_value(value)}")
    output = os.path.join(run_dir.replace("%", "%%"), "slurm-%j.out")  # %j: sbatch puts the job id there
    lines += [f"#SBATCH --output={directive_value(output)}", "#SBATCH --open-mode=append"]
    if early:
        lines.append(f"# SIGUSR1 {options.save_before} s before the time limit: the ranks save a checkpoint and stop")
        lines.append(f"#SBATCH --signal={early}")
    return lines


def _body(argv: list[str], run_dir: str, workdir: str, resume: bool, again: str, requeue: bool) -> list[str]:
    """The script's commands: refuse to run as a job array's task, set RUN_DIR, cd to where submit ran, and
    ``exec`` zerorun train (the batch shell becomes the launcher: ``B:`` signals reach it); with ``requeue``, a
    requeued run adds ``--resume``."""
    q = shlex.quote
    cut = resume  # --resume goes on the options' line
    lines = [
        "",
        "# a job array's tasks would all train into this one run folder (sbatch --array RUN_DIR/submit.sbatch)",
        'if [ -n "${SLURM_ARRAY_TASK_ID:-}" ]; then',
        '    echo "zerorun: error: this script runs one job, not a job array (task $SLURM_ARRAY_TASK_ID): every '
        'task would train into one run folder; submit one job per setting" >&2',
        "    exit 2",
        "fi",
        "# where the job writes (the same folder as --output above)",
        f"RUN_DIR={q(run_dir)}",
        "# how a job stopped by the time limit (or scancel) continues: its stop message names this",
        f"export ZERORUN_CONTINUE={q(again)}",
        "# where zerorun submit ran: relative paths of the overrides and of log.dir / checkpoint.dir start here",
        f"cd {q(workdir)} || exit 1",
        "# the Python that ran zerorun submit: every node must see it at this path (a shared file system)",
        "exec " + shlex.join(argv[:5]) + " \\",
        # a requeued run (SLURM_RESTART_COUNT set) continues the job's own checkpoints: Note [One job's checkpoints
        # per folder] in zerorun/checkpoint/resume.py refuses a new start beside them
        "    " + shlex.join(argv[5:10 + cut]) + ' --run-dir "$RUN_DIR"' + (" ${SLURM_RESTART_COUNT:+--resume}"
                                                                          if requeue else "")
        + (" \\" if argv[10 + cut:] else ""),
    ]
    if argv[10 + cut:]:
        lines.append("    " + shlex.join(argv[10 + cut:]))
    return lines


def _write_run_dir(run_dir: str, recipe_yaml: str, text: str) -> list[str]:
    """Make ``run_dir`` with ``recipe.yaml`` and ``submit.sbatch`` in it; return the folders made (outermost
    first), for a refused submit to remove.

    Raises:
        ZerorunError: a folder or file that cannot be written (what was made is removed).
    """
    made, folder = [], run_dir
    while folder and not os.path.exists(folder):
        made.insert(0, folder)
        folder = os.path.dirname(folder)
    script = os.path.join(run_dir, SCRIPT_NAME)
    try:
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, runfolder.RECIPE), "w", encoding="utf-8") as f:
            f.write(recipe_yaml)
        with open(script, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(script, 0o755)
    except OSError as e:
        if run_dir in made:
            shutil.rmtree(run_dir, ignore_errors=True)
        raise ZerorunError(f"log.dir: cannot write the run folder {run_dir}: {e.strerror}") from None
    return made


def _rmdir(folder: str) -> None:
    """Remove ``folder`` when it is empty (a parent of the run folder that submit made)."""
    try:
        os.rmdir(folder)
    except OSError:
        pass


def _refuse_env_overrides(overrides: list[str]) -> None:
    """Raises ZerorunError for a ``launch.env`` override: the script repeats the overrides, so its values would be
    written into it."""
    for item in overrides:
        if item.split("=", 1)[0].strip().startswith("launch.env"):
            raise ZerorunError(f"override {item.split('=', 1)[0]!r}: its values would be written into the batch "
                               "script; set launch.env in the recipe or in an environment file (.zerorun_env)")


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
    from zerorun.checkpoint.files import resolve
    from zerorun.checkpoint.resume import check_save_folder
    from zerorun.launch.run import new_run_dir
    from zerorun.recipe import load_recipe, masked_yaml

    out = out or sys.stdout
    _refuse_env_overrides(overrides)
    recipe = load_recipe(recipe_path, overrides, check_optimizer=False)
    if options.resume not in (None, "latest") and not os.path.exists(options.resume):
        raise ZerorunError(f"--resume {options.resume}: no such checkpoint")
    if options.resume != "latest":  # refused now, not in the job (Note [One job's checkpoints per folder])
        planned = recipe.model_copy(deep=True)
        given = options.resume or planned.checkpoint.resume
        planned.checkpoint.resume = resolve(given) if given else None  # a folder of checkpoints: its latest
        check_save_folder(planned)
    sbatch = None if dry_run else shutil.which("sbatch")
    if not dry_run and sbatch is None:
        raise ZerorunError("sbatch: not found on PATH (zerorun submit needs SLURM's client commands; "
                           "--dry-run writes the script without them)")
    if not dry_run:
        check_partition_size(options.nodes, group_args(options.sbatch_args), options.partition)
    run_dir = os.path.abspath(new_run_dir(recipe.log.dir, recipe.name, uuid.uuid4().hex))
    text = render_script(recipe=recipe, recipe_path=recipe_path, overrides=overrides, options=options,
                         run_dir=run_dir, workdir=os.getcwd(), command=command)
    made = _write_run_dir(run_dir, masked_yaml(recipe), text)
    script = os.path.join(run_dir, SCRIPT_NAME)
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
    if not job_id:  # nothing was queued: leave no run folder behind (a timeout above may have queued it)
        shutil.rmtree(run_dir, ignore_errors=True)
        for folder in reversed(made[:-1]):  # the parents submit made, when nothing else is in them
            _rmdir(folder)
        raise ZerorunError(f"sbatch refused the job: {one_line(done.stderr or done.stdout)} (nothing was queued "
                           "and no run folder kept; --dry-run writes the script without submitting it)")
    remember(job_id, run_dir, in_run_dir=True)
    out.write(f"zerorun: submitted job {job_id}: {recipe.name} on {options.nodes} node"
              f"{'s' * (options.nodes != 1)}; run dir {run_dir}\n"
              f"zerorun: follow it with: zerorun attach {job_id}\n")
    out.flush()
    return job_id, run_dir
