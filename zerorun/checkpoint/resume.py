"""``zerorun train --resume [PATH]``: which checkpoint a job resumes from, decided in the launcher.

Note [Resume lookup]: ``--resume`` without a path means "resume if there is something to resume": it looks
for the latest complete checkpoint (Note [Atomic checkpoints] in ``saving.py``) in ``checkpoint.dir``, or,
when the recipe sets none, in the default folder ``<log.dir>/<name>/checkpoints`` (what ``checkpoint.every``
alone saves into; run folders are ``<log.dir>/<name>/<timestamp>-<job>``, so the default is the same for every
run of a recipe name, as DeepSpeed's and Hugging Face's ``output_dir``). Found: the job resumes from it and
keeps saving into that folder. None there (a first run, or only saves that were cut short): the job starts
from step 0 and says so in one line, saving into that folder (at the end at least), so the same command line
resumes next time. ``--resume PATH`` names a checkpoint, or a folder of them (its latest), that must exist:
anything else is an error, as is a checkpoint that fails its checks (``checkpoint.check``). A checkpoint
saved after ``train.steps`` or later leaves nothing to train: an error, not a job that does nothing. What a
changed ``train.steps`` or ``train.schedule`` does to the LR: Note [LR schedule on resume] in ``rank/schedule.py``.

Note [One job's checkpoints per folder]: a job prunes its folder to ``checkpoint.keep`` and replaces a ``step-N``
of the same number, so a folder holds the checkpoints of one line of jobs, each resumed from the last. A job
that would save into a folder holding complete checkpoints it does not continue (a new job without ``--resume``
on the default folder of an earlier run of the recipe; a ``--resume PATH`` from another folder) is refused before
it starts (:func:`check_save_folder`), naming the ways out: ``--resume``, a folder of its own, or removing them.
Otherwise the earlier job's checkpoints, of later steps too, were replaced or pruned without a word (found by
review). Hugging Face's example scripts refuse a non-empty ``output_dir`` in the same way.
"""

from __future__ import annotations

import json
import os
import re
import sys
from typing import Callable

from zerorun.errors import ZerorunError

#: What the command line passes for a bare ``--resume`` (cli.optional_value).
LATEST = "latest"


def default_dir(recipe) -> str:
    """``<log.dir>/<name>/checkpoints`` as an absolute path (``log.dir`` relative to the working directory)."""
    return os.path.abspath(os.path.expanduser(os.path.join(recipe.log.dir, recipe.name, "checkpoints")))


def _incomplete(root: str) -> int:
    """Saves under ``root`` that never completed: ``step-N`` folders without their marker, ``.step-N.<job>.tmp``."""
    from zerorun.checkpoint.files import MARKER, STEP_DIR

    try:
        names = os.listdir(root)
    except OSError:
        return 0
    return sum(1 for n in names if re.fullmatch(r"\.step-\d+(\.[\w-]+)?\.tmp", n) or
               (STEP_DIR.fullmatch(n) and not os.path.isfile(os.path.join(root, n, MARKER))))


def prepare_resume(recipe, resume: str | None, say: Callable[[str], None] | None = None) -> bool:
    """Apply ``--resume`` (``None``: not given, then the recipe's ``checkpoint.resume`` if set, taken as a
    PATH; :data:`LATEST`: bare; else a PATH) to the resolved ``recipe``:
    set ``checkpoint.resume`` (the checkpoint folder the ranks load, or ``None`` to start from step 0) and
    ``checkpoint.dir`` (where the job saves), and ``say`` one line when the job starts fresh or the LR schedule
    differs from the checkpoint's (Note [Resume lookup]). ``say`` defaults to printing on stdout.

    Returns:
        ``False`` when the checkpoint was saved after step ``train.steps`` (the job is done: a requeued job
        or the same command run again; ``say`` says so and the launcher exits 0, as Hugging Face's Trainer
        does), else ``True``.

    Raises:
        ZerorunError: a baseline runtime (no checkpoints), a PATH that does not exist or holds no complete
            checkpoint, a checkpoint that fails its checks, or one saved after a later step than ``train.steps``.
    """
    initial = recipe.checkpoint.resume  # the recipe's own (a pretrained start): checked as PATH
    resume = resume if resume is not None else initial
    if resume is None:
        check_save_folder(recipe)
        return True
    say = say or (lambda line: print(line, file=sys.stdout, flush=True))
    from zerorun.checkpoint import files as checkpoint

    ckpt = recipe.checkpoint
    if recipe.runtime != "zero":
        raise ZerorunError(f"--resume: checkpoints are zerorun's (runtime zero); the {recipe.runtime} baseline "
                           "does not save them")
    path = _latest(recipe, initial, say) if resume == LATEST else checkpoint.resolve(resume)
    if path is None:
        ckpt.resume = None
        check_save_folder(recipe)
        return True
    meta = checkpoint.check(path)
    if meta["scheduler"] is None:  # the ranks would refuse it after the launch (loading.py), with a script's hint
        raise ZerorunError(f"{os.path.join(path, checkpoint.META)}: saved without an LR scheduler (by a script of "
                           "your own?): zerorun train resumes checkpoints saved with one")
    ckpt.resume = path
    ckpt.dir = ckpt.dir or os.path.dirname(path)  # keep saving beside it
    step, steps = int(meta["step"]), recipe.train.steps
    if step == steps:
        say(f"zerorun: {path} was saved after step {step}, the last of train.steps: the job is done, nothing to "
            "train (raise train.steps to train on)")
        return False
    saved_by = (meta.get("recipe") or {}).get("name")  # another recipe's checkpoint: said first (found by review)
    other = f" by recipe {saved_by!r}" if isinstance(saved_by, str) and saved_by != recipe.name else ""
    if step > steps:
        raise ZerorunError(f"--resume: {path} was saved{other} after step {step} and train.steps is {steps}: "
                           "nothing left to train (raise train.steps to train on)")
    check_save_folder(recipe)
    for line in (schedule_change(meta, recipe, step), optimizer_change(meta, recipe, path)):
        if line:
            say(line)
    return True


def _latest(recipe, initial: str | None, say: Callable[[str], None]) -> str | None:
    """A bare ``--resume``: the latest complete checkpoint of ``checkpoint.dir`` (its default made), else the
    recipe's own ``checkpoint.resume`` (``initial``: a pretrained start; found by review: a requeued fine-tuning
    job started from step 0), else None (step 0); ``say`` says which where it is not the latest, or none."""
    from zerorun.checkpoint import files as checkpoint

    ckpt = recipe.checkpoint
    ckpt.dir = ckpt.dir or default_dir(recipe)
    path, cut = checkpoint.latest(ckpt.dir), _incomplete(ckpt.dir)
    unfinished = f" ({cut} unfinished save{'s' * (cut > 1)} ignored)" if cut else ""
    if path is None and initial is not None:
        say(f"zerorun: no checkpoint in {ckpt.dir} yet{unfinished}: starting from the recipe's checkpoint.resume, "
            f"{initial}")
        return checkpoint.resolve(initial)
    if path is None:
        say(f"zerorun: no checkpoint in {ckpt.dir} yet{unfinished}: starting from step 0"
            + ("" if ckpt.every else "; it will be saved there at the end"))
    elif cut:  # a save cut short: the line says which checkpoint is taken instead
        say(f"zerorun: {cut} unfinished save{'s' * (cut > 1)} in {ckpt.dir} ignored: resuming from the latest "
            f"complete checkpoint, {os.path.basename(path)}")
    return path


def check_save_folder(recipe) -> None:
    """Note [One job's checkpoints per folder]: the job may save into ``checkpoint.dir`` (none set: it saves
    nothing): the folder holds no complete checkpoint, or the one ``checkpoint.resume`` names is among them.

    Raises:
        ZerorunError: the folder holds complete checkpoints this job does not continue, naming the latest.
    """
    from zerorun.checkpoint.files import list_complete

    ckpt = recipe.checkpoint
    foreign = _not_ours(ckpt.dir, _steps_at_risk(recipe)) if ckpt.dir else None
    if foreign:
        raise ZerorunError(f"checkpoint.dir {ckpt.dir}: {foreign} (it holds what no checkpoint does): move it out, "
                           "or give this job another checkpoint.dir")
    found = list_complete(ckpt.dir) if ckpt.dir else []
    if not found or (ckpt.resume and os.path.dirname(os.path.realpath(ckpt.resume)) == os.path.realpath(ckpt.dir)):
        return  # the resumed checkpoint (through a link to it too) is one of the folder's
    latest, them = os.path.basename(found[-1][2]), "them" if len(found) > 1 else "it"
    held = f"{len(found)} checkpoints of an earlier job ({latest} the latest)" if len(found) > 1 else \
        f"a checkpoint of an earlier job ({latest})"
    why = (f"this job resumes from {ckpt.resume} and would save beside {them}" if ckpt.resume else
           f"a new job would save beside {them}")
    free = next(f"{ckpt.dir}-{n}" for n in range(2, 10**6) if not list_complete(f"{ckpt.dir}-{n}"))
    raise ZerorunError(f"checkpoint.dir {ckpt.dir} holds {held}: {why}, replacing and pruning {them} "
                       f"(checkpoint.keep {ckpt.keep}). Continue that job with --resume, give this one a folder of "
                       f"its own (checkpoint.dir={free}), or remove {them} first")


def _steps_at_risk(recipe) -> dict[int, str]:
    """The steps whose ``step-N`` entries this job would replace (the ``checkpoint.every``-th after the step it
    resumes from, and the last) or remove (the complete checkpoints ``checkpoint.keep`` prunes once they are
    saved), with what would do it. A SIGTERM's save of another step is not foreseen."""
    from zerorun.checkpoint.files import STEP_DIR, list_complete

    ckpt, steps = recipe.checkpoint, recipe.train.steps
    named = STEP_DIR.fullmatch(os.path.basename(os.path.realpath(ckpt.resume))) if ckpt.resume else None
    start = int(named.group(1)) if named else 0  # a save's folder is named for its step (the resume checks it)
    first = (start // ckpt.every + 1) * ckpt.every if ckpt.every else steps
    saves = {s: "which a save of that step would replace" for s in [*range(first, steps, ckpt.every or steps), steps]
             if s > start}
    older = [step for _, step, _ in list_complete(ckpt.dir) if step not in saves]
    kept = max(ckpt.keep - len(saves), 0)  # the newest checkpoint.keep complete ones stay
    pruned = {step: f"which checkpoint.keep {ckpt.keep} would prune" for step in older[:len(older) - kept]}
    return {**pruned, **saves}


def _not_ours(folder: str, steps: dict[int, str]) -> str | None:
    """A ``step-N`` entry of ``folder`` among ``steps`` (:func:`_steps_at_risk`) holding what no save writes: a
    file of that name, or a file of another name inside (a save had removed a user's notes without a word: a
    review). Returns it in words, or None."""
    from zerorun.checkpoint.files import SAVED, STEP_DIR

    try:
        names = sorted(n for n in os.listdir(folder) if (m := STEP_DIR.fullmatch(n)) and int(m.group(1)) in steps)
    except OSError:  # not made yet, or unreadable: the save says so itself
        return None
    for name in names:
        path, why = os.path.join(folder, name), steps[int(STEP_DIR.fullmatch(name).group(1))]
        if not os.path.isdir(path):
            return f"{name} is a file, {why}"
        try:
            other = next((n for n in sorted(os.listdir(path)) if not SAVED.fullmatch(n)), None)
        except OSError:
            continue
        if other is not None:
            return f"{name} holds {other}, {why}"
    return None


def optimizer_change(meta: dict, recipe, path: str = "the checkpoint") -> str | None:
    """One line naming the ``train.optimizer`` options of ``recipe`` that differ from those the checkpoint
    (``meta``, its ``zerorun.json``) trains with: its param groups' (``initial_lr`` is the base lr, the largest
    ``weight_decay`` the decay group's), restored with the optimizer's states, so the checkpoint's are used; where a
    group holds no such option, the recipe it was saved with. ``None`` when none differs or nothing is known.

    Raises:
        ZerorunError: the recipe names another optimizer than the checkpoint's (the ranks would refuse it after
            the launch).
    """
    saved = ((meta.get("recipe") or {}).get("train") or {}).get("optimizer")
    groups = (meta.get("layout") or {}).get("param_groups")
    if not isinstance(saved, dict):
        return None
    now = json.loads(json.dumps(recipe.train.optimizer.model_dump()))  # as zerorun.json holds it (lists)
    old_name = (meta.get("layout") or {}).get("optimizer") or saved.get("name")
    if isinstance(old_name, str) and old_name != now.get("name"):
        raise ZerorunError(f"--resume: {path}: train.optimizer {now.get('name')} in "
                           f"the recipe, {old_name} in the checkpoint: its states are {old_name}'s; resume with "
                           f"train.optimizer.name {old_name}, or start without --resume")
    used = dict(saved)
    if isinstance(groups, list) and groups and all(isinstance(g, dict) for g in groups):
        used.update({k: v for k, v in groups[0].items() if k in now or k in saved})
        used["lr"] = groups[0].get("initial_lr", groups[0].get("lr", saved.get("lr")))
        decays = [g["weight_decay"] for g in groups if isinstance(g.get("weight_decay"), (int, float))]
        used["weight_decay"] = max(decays) if decays else saved.get("weight_decay")
    changes = [f"train.optimizer.{k} {now.get(k, 'unset')} in the recipe, {used.get(k, 'unset')} in the checkpoint"
               for k in sorted(set(now) | set(saved)) if k != "name" and now.get(k) != used.get(k)]
    if not changes:
        return None
    one = len(changes) == 1
    return (f"zerorun: resuming with {'; '.join(changes)}: the checkpoint's {'is' if one else 'are'} used (the "
            "optimizer's options are restored with its states; start without --resume to use the recipe's)")


def batch_change(recipe, world: int) -> str | None:
    """One line when the global batch of ``recipe`` on ``world`` ranks differs from the one the checkpoint it
    resumes from was saved under (its ranks x ``train.grad_accum_steps`` x ``train.micro_batch_size``), as a
    restart on fewer ranks says it (Note [Lost nodes]); ``None`` when it is the same or not known."""
    from zerorun.checkpoint import files as checkpoint

    if recipe.checkpoint.resume is None:
        return None
    meta = checkpoint.read_meta(recipe.checkpoint.resume)
    train = ((meta.get("recipe") or {}).get("train") or {})
    old = (meta.get("world_size"), train.get("grad_accum_steps", 1), train.get("micro_batch_size"))
    if not all(isinstance(v, int) for v in old):
        return None
    new = (world, recipe.train.grad_accum_steps, recipe.train.micro_batch_size)
    if old[0] * old[1] * old[2] == new[0] * new[1] * new[2]:
        return None

    def said(w: int, a: int, m: int) -> str:
        return f"{w * a * m} samples ({w} ranks x {a} accumulation steps x {m} samples per micro-batch)"
    return (f"zerorun: resuming with a global batch of {said(*new)}, the checkpoint's was {said(*old)}: the loss "
            "curve changes")


def schedule_change(meta: dict, recipe, step: int) -> str | None:
    """One line saying how the LR schedule of ``recipe`` differs from the one the checkpoint (``meta``, its
    ``zerorun.json``) was saved under, with the LR before and after the resume point; ``None`` when it is the
    same (Note [LR schedule on resume])."""
    from zerorun.recipe import ScheduleSpec
    from zerorun.rank.schedule import lr_multiplier

    saved = ((meta.get("recipe") or {}).get("train") or {})
    try:
        old_spec = ScheduleSpec.model_validate(saved.get("schedule") or {})
        old_steps = int(saved["steps"])
        base = float((saved.get("optimizer") or {}).get("lr", recipe.train.optimizer.lr))
        # the base LR it trains with: its param groups' (a resumed run's saved recipe may name another)
        base = float(((meta.get("layout") or {}).get("param_groups") or [{}])[0].get("initial_lr", base))
    except (KeyError, TypeError, ValueError, AttributeError):
        return None  # a checkpoint without its recipe's schedule: nothing to compare with
    new_spec, new_steps = recipe.train.schedule, recipe.train.steps
    changes = [f"train.steps {old_steps} -> {new_steps}"] if old_steps != new_steps else []
    for field, value in new_spec.model_dump().items():
        if getattr(old_spec, field) != value:
            changes.append(f"train.schedule.{field} {getattr(old_spec, field)} -> {value}")
    if not changes:
        return None
    before = base * lr_multiplier(old_spec, old_steps)(step - 1)
    after = base * lr_multiplier(new_spec, new_steps)(step)
    return (f"zerorun: resuming after step {step} with {', '.join(changes)}: the LR schedule is recomputed as for "
            f"a run of {new_steps} steps from the start (lr {before:.3g} at step {step}, {after:.3g} at step "
            f"{step + 1})")
