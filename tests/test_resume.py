"""``zerorun train --resume``: resume when there is a checkpoint, start from step 0 (and say so) when there is
none, in the default folder ``<log.dir>/<name>/checkpoints``; a raised ``train.steps`` continues with the
longer run's LR schedule (Note [Resume lookup] in zerorun/checkpoint/resume.py, Note [LR schedule on resume] in
zerorun/rank/schedule.py)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from test_train_e2e import TINY, zerorun
from zerorun.errors import ZerorunError
from zerorun.recipe import ScheduleSpec, load_recipe
from zerorun.checkpoint.resume import LATEST, check_save_folder, prepare_resume
from zerorun.rank.schedule import continue_schedule, lr_multiplier


def _lrs(scheduler, steps: range) -> list[float]:
    """The LR each optimizer step in ``steps`` uses (as the worker logs it: before ``scheduler.step()``)."""
    out = []
    for _ in steps:
        out.append(scheduler.optimizer.param_groups[0]["lr"])
        scheduler.optimizer.step()
        scheduler.step()
    return out


def _scheduler(spec, steps: int):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=3e-3)
    return torch.optim.lr_scheduler.LambdaLR(opt, lr_multiplier(spec, steps))


@pytest.mark.parametrize("old_steps,new_steps,warmup", [(4, 6, 3), (10, 10, 3), (4, 40, 8), (30, 60, 0)])
def test_lr_after_resume_is_the_lr_of_an_uninterrupted_run_of_the_new_recipe(old_steps, new_steps, warmup):
    """Saved after ``old_steps`` of an ``old_steps`` run, resumed with ``train.steps = new_steps``: every step
    after the saved one uses exactly the LR of an uninterrupted ``new_steps`` run (same recipe: bit for bit);
    warm-up beyond the saved step is finished, not restarted."""
    spec = ScheduleSpec(warmup_steps=warmup, decay="cosine", min_lr_ratio=0.1)
    reference = _lrs(_scheduler(spec, new_steps), range(new_steps))
    first = _scheduler(spec, old_steps)
    _lrs(first, range(old_steps))
    saved_scheduler, saved_groups = first.state_dict(), [dict(g, params=None) for g in first.optimizer.param_groups]
    resumed = _scheduler(spec, new_steps)
    for group, saved in zip(resumed.optimizer.param_groups, saved_groups):  # as zero/state.py restores them
        group.update({k: v for k, v in saved.items() if k != "params"})
    resumed.load_state_dict(saved_scheduler)
    continue_schedule(resumed)
    assert _lrs(resumed, range(old_steps, new_steps)) == reference[old_steps:]


def test_bare_resume_without_a_checkpoint_starts_from_step_0_in_the_default_folder(tmp_path):
    r = load_recipe(TINY, [f"log.dir={tmp_path}"])
    said: list[str] = []
    prepare_resume(r, LATEST, say=said.append)
    default = str(tmp_path / "tiny" / "checkpoints")
    assert r.checkpoint.dir == default and r.checkpoint.resume is None
    assert said == [f"zerorun: no checkpoint in {default} yet: starting from step 0; it will be saved there at "
                    "the end"]
    os.makedirs(os.path.join(default, ".step-00000004.tmp"))  # saves that were cut short are no checkpoint
    os.makedirs(os.path.join(default, "step-00000002"))
    r = load_recipe(TINY, [f"log.dir={tmp_path}", "checkpoint.every=2"])
    said.clear()
    prepare_resume(r, LATEST, say=said.append)
    assert r.checkpoint.resume is None and said == [
        f"zerorun: no checkpoint in {default} yet (2 unfinished saves ignored): starting from step 0"]
    prepare_resume(r, None, say=said.append)  # no --resume: nothing changes
    assert len(said) == 1
    with pytest.raises(ZerorunError, match=r"no such checkpoint directory"):
        prepare_resume(r, str(tmp_path / "nope"))
    r = load_recipe(TINY, [f"checkpoint.resume={tmp_path / 'gone'}"])  # the recipe's own is checked as a PATH
    with pytest.raises(ZerorunError, match=rf"^{tmp_path / 'gone'}: no such checkpoint directory$"):
        prepare_resume(r, None)
    with pytest.raises(ZerorunError, match=r"^--resume: checkpoints are zerorun's .* the fsdp2 baseline"):
        prepare_resume(load_recipe(TINY, ["runtime=fsdp2"]), LATEST)


@pytest.mark.slow
def test_resume_just_works_first_run_then_more_steps(tmp_path):
    """The same command line twice, from a folder that is not the repository's: the first run finds no
    checkpoint and starts from step 0, saving into runs/tiny/checkpoints; the second, with train.steps raised
    from 4 to 6, resumes after step 4 from there, with the 6-step run's LR at steps 5 and 6. A third with
    nothing left to train is an error. (1 rank: two short launches.)"""
    args = ["train", TINY, "train.steps=4", "checkpoint.every=2", "log.every=1", "train.eval_every=0",
            "launch.procs_per_node=1", "--no-dashboard", "--resume"]
    default = tmp_path / "runs" / "tiny" / "checkpoints"
    first = zerorun(*args, cwd=str(tmp_path))
    assert first.returncode == 0, first.stdout + first.stderr
    assert f"zerorun: no checkpoint in {default} yet: starting from step 0\n" in first.stdout
    assert sorted(os.listdir(default)) == ["step-00000002", "step-00000004"]

    second = zerorun(*args, "train.steps=6", cwd=str(tmp_path))
    assert second.returncode == 0, second.stdout + second.stderr
    assert f"resumed from {default / 'step-00000004'} after step 4" in second.stdout
    assert ("zerorun: resuming after step 4 with train.steps 4 -> 6: the LR schedule is recomputed as for a run of "
            "6 steps from the start (lr 0.003 at step 4, 0.00165 at step 5)\n") in second.stdout, second.stdout
    runs = sorted(p for p in (tmp_path / "runs" / "tiny").iterdir() if p.name != "checkpoints")
    assert len(runs) == 2  # one folder per run, one checkpoint folder for both
    events = [json.loads(line) for run in runs for line in (run / "metrics.jsonl").read_text().splitlines()]
    lr = {e["step"]: e["lr"] for e in events if e["event"] == "step" and e["step"] > 4}
    spec = load_recipe(TINY).train.schedule
    assert sorted(lr) == [5, 6]
    for step in (5, 6):
        assert lr[step] == pytest.approx(3e-3 * lr_multiplier(spec, 6)(step - 1), rel=1e-12), (step, lr)
    assert sorted(os.listdir(default)) == ["step-00000004", "step-00000006"]  # keep: 2

    # the same line once more (a requeued job): done, nothing to train, exit 0 (the launcher's check, here in
    # this process); a checkpoint past train.steps is an error
    said = []
    assert prepare_resume(load_recipe(TINY, ["train.steps=6", f"log.dir={tmp_path / 'runs'}"]), LATEST,
                          say=said.append) is False
    assert said == [f"zerorun: {default / 'step-00000006'} was saved after step 6, the last of train.steps: the "
                    "job is done, nothing to train (raise train.steps to train on)"]
    with pytest.raises(ZerorunError) as e:
        prepare_resume(load_recipe(TINY, ["train.steps=5", f"log.dir={tmp_path / 'runs'}"]), LATEST)
    assert str(e.value) == (f"--resume: {default / 'step-00000006'} was saved after step 6 and train.steps is 5: "
                            "nothing left to train (raise train.steps to train on)")
    with pytest.raises(ZerorunError) as e:  # another recipe's checkpoint: said first (found by review: the advice
        prepare_resume(load_recipe(TINY, ["name=mlp", "train.steps=5"]), str(default))  # to raise train.steps only)
    assert str(e.value).startswith(f"--resume: {default / 'step-00000006'} was saved by recipe 'tiny' after step 6 ")
    # a job that starts from the recipe's checkpoint.resume (fine-tuning) into a folder of its own, with a bare
    # --resume (a requeued batch job's): none of its own yet, so from the recipe's, not from step 0 (found by review)
    said, start = [], str(default / "step-00000006")
    r = load_recipe(TINY, ["train.steps=8", f"log.dir={tmp_path / 'runs'}", f"checkpoint.dir={tmp_path / 'ft'}",
                           f"checkpoint.resume={start}"])
    assert prepare_resume(r, LATEST, say=said.append) and r.checkpoint.resume == start
    assert said[0] == (f"zerorun: no checkpoint in {tmp_path / 'ft'} yet: starting from the recipe's "
                       f"checkpoint.resume, {start}"), said


def _checkpoint(folder, meta_step, marker_step=None):
    """A checkpoint folder as far as ``read_meta`` reads it: ``COMPLETE`` and ``zerorun.json``."""
    from zerorun.checkpoint import files

    folder.mkdir()
    marker = {"saved_at": 1.0} if marker_step is None else {"step": marker_step, "saved_at": 1.0}
    (folder / files.MARKER).write_text(json.dumps(marker))
    meta = {"format": files.FORMAT, "step": meta_step, "world_size": 2, "layout": {}, "scheduler": {}, "data": {}}
    (folder / files.META).write_text(json.dumps(meta))
    return str(folder)


@pytest.mark.parametrize("name,meta_step,marker_step,differs", [
    ("step-00000574", 57, 574, "the folder's name step-00000574 and its COMPLETE marker's step 574"),
    ("step-00000574", 57, None, "the folder's name step-00000574"),
    ("best", 57, 574, "its COMPLETE marker's step 574"),  # a folder renamed by the user: its marker still says
    ("step-00000574", 575, 575, "the folder's name step-00000574"),
])
def test_a_hand_edited_step_is_refused(tmp_path, name, meta_step, marker_step, differs):
    from zerorun.checkpoint import files

    path = _checkpoint(tmp_path / name, meta_step, marker_step)
    with pytest.raises(ZerorunError) as e:
        files.read_meta(path)
    assert str(e.value) == (f"{path}/zerorun.json: step {meta_step} differs from {differs}: the checkpoint is "
                            "inconsistent (edited by hand?); refusing it")
    assert e.value.exit_code == 2


@pytest.mark.parametrize("step", ["574", 57.0, True, -1, None])
def test_a_step_that_is_no_whole_number_is_refused(tmp_path, step):
    from zerorun.checkpoint import files

    path = _checkpoint(tmp_path / "step-00000574", step, 574)
    with pytest.raises(ZerorunError) as e:
        files.read_meta(path)
    assert str(e.value) == f"{path}/zerorun.json: step: expected a whole number of steps, got {step!r}"


@pytest.mark.parametrize("name,marker_step", [("step-00000574", 574), ("step-00000574", None), ("best", 574)])
def test_a_consistent_step_is_read(tmp_path, name, marker_step):
    from zerorun.checkpoint import files

    assert files.read_meta(_checkpoint(tmp_path / name, 574, marker_step))["step"] == 574


def _saved(recipe, world_size=2) -> dict:
    """``zerorun.json``'s fields that a resume compares: the recipe the checkpoint was saved under (as JSON) and
    its ranks."""
    return {"step": 10, "world_size": world_size, "recipe": json.loads(json.dumps(recipe.model_dump()))}


@pytest.mark.parametrize("overrides,expected", [
    ([], None),
    (["train.optimizer.lr=1.0"], "train.optimizer.lr 1.0 in the recipe, 0.003 in the checkpoint: the checkpoint's "
                                 "is used"),
    (["train.optimizer.lr=1.0", "train.optimizer.weight_decay=0.0"],
     "train.optimizer.lr 1.0 in the recipe, 0.003 in the checkpoint; train.optimizer.weight_decay 0.0 in the "
     "recipe, 0.1 in the checkpoint: the checkpoint's are used"),
    (["train.optimizer.betas=[0.8, 0.9]"], "train.optimizer.betas [0.8, 0.9] in the recipe, unset in the "
                                           "checkpoint: the checkpoint's is used"),
])
def test_changed_optimizer_options_are_said_on_resume(overrides, expected):
    from zerorun.checkpoint.resume import optimizer_change

    line = optimizer_change(_saved(load_recipe(TINY)), load_recipe(TINY, overrides))
    assert line == (None if expected is None else f"zerorun: resuming with {expected} (the optimizer's options "
                    "are restored with its states; start without --resume to use the recipe's)")


def test_the_optimizer_options_said_on_resume_are_those_the_checkpoint_trains_with():
    """A second resume: the checkpoint was saved by a run that resumed with lr 0.01 in its recipe and trained on
    with the first run's 0.003 (its param groups'). The line named 0.01 as the checkpoint's, and a recipe back at
    0.01 got no line at all (a review); the param groups are what is restored. Another optimizer is refused
    before the launch (the ranks refused it after, as "another model")."""
    from zerorun.checkpoint.resume import optimizer_change

    meta = _saved(load_recipe(TINY, ["train.optimizer.lr=0.01"]))
    meta["layout"] = {"optimizer": "AdamW", "param_groups": [{"lr": 3e-4, "initial_lr": 0.003, "weight_decay": 0.1},
                                                             {"lr": 3e-4, "initial_lr": 0.003, "weight_decay": 0.0}]}
    assert optimizer_change(meta, load_recipe(TINY)) is None  # the recipe's 0.003 is what trains
    line = optimizer_change(meta, load_recipe(TINY, ["train.optimizer.lr=0.01"]))
    assert line.startswith("zerorun: resuming with train.optimizer.lr 0.01 in the recipe, 0.003 in the checkpoint: "
                           "the checkpoint's is used"), line
    from zerorun.checkpoint.resume import schedule_change
    from zerorun.rank.schedule import lr_multiplier

    tiny = load_recipe(TINY)  # the LRs said around the resume point are the 0.003 it trains with, not 0.01
    line = schedule_change(meta, load_recipe(TINY, [f"train.steps={tiny.train.steps + 10}"]), tiny.train.steps)
    old = 0.003 * lr_multiplier(tiny.train.schedule, tiny.train.steps)(tiny.train.steps - 1)
    assert f"(lr {old:.3g} at step {tiny.train.steps}," in line, line
    with pytest.raises(ZerorunError, match=r"^--resume: the checkpoint: train.optimizer SGD in the recipe, AdamW in "
                                           r"the checkpoint: its states are AdamW's"):
        optimizer_change(meta, load_recipe(TINY, ["train.optimizer={name: SGD, lr: 0.01}"]))


@pytest.mark.parametrize("world,overrides,expected", [
    (2, [], None),
    (4, ["train.micro_batch_size=2"], None),  # the same 8 samples
    (2, ["train.micro_batch_size=2"], "4 samples (2 ranks x 1 accumulation steps x 2 samples per micro-batch)"),
    (4, ["train.grad_accum_steps=3"], "48 samples (4 ranks x 3 accumulation steps x 4 samples per micro-batch)"),
])
def test_a_changed_global_batch_is_said_on_resume(tmp_path, monkeypatch, world, overrides, expected):
    from zerorun.checkpoint import files
    from zerorun.checkpoint.resume import batch_change

    r = load_recipe(TINY, overrides)
    r.checkpoint.resume = str(tmp_path)
    monkeypatch.setattr(files, "read_meta", lambda path: _saved(load_recipe(TINY)) if path == str(tmp_path) else 0)
    line = batch_change(r, world)
    assert line == (None if expected is None else f"zerorun: resuming with a global batch of {expected}, the "
                    "checkpoint's was 8 samples (2 ranks x 1 accumulation steps x 4 samples per micro-batch): the "
                    "loss curve changes")


def _complete(root, step: int, saved_at: float) -> str:
    """A complete checkpoint folder as far as ``list_complete`` reads it (its ``COMPLETE`` marker)."""
    from zerorun.checkpoint import files

    path = root / f"step-{step:08d}"
    path.mkdir(parents=True)
    (path / files.MARKER).write_text(json.dumps({"saved_at": saved_at}))
    return str(path)


def test_a_job_never_saves_beside_checkpoints_it_does_not_continue(tmp_path):
    """Note [One job's checkpoints per folder] (found by review: a second run of the same command line without
    --resume replaced the first run's step 10 and pruned its steps 20 and 30, without a word)."""
    default = tmp_path / "tiny" / "checkpoints"
    _complete(default, 20, 1.0)
    _complete(default, 30, 2.0)
    (default / ".step-00000040.abc.tmp").mkdir()
    fresh = [f"log.dir={tmp_path}", "checkpoint.every=10"]
    with pytest.raises(ZerorunError) as e:
        prepare_resume(load_recipe(TINY, fresh), None)
    assert str(e.value) == (
        f"checkpoint.dir {default} holds 2 checkpoints of an earlier job (step-00000030 the latest): a new job would "
        "save beside them, replacing and pruning them (checkpoint.keep 2). Continue that job with --resume, give this "
        f"one a folder of its own (checkpoint.dir={default}-2), or remove them first")
    assert e.value.exit_code == 2
    other = tmp_path / "elsewhere"
    elsewhere = _complete(other, 10, 3.0)
    r = load_recipe(TINY, fresh)
    r.checkpoint.resume = elsewhere  # as prepare_resume sets it for --resume PATH (whose checks need a real one)
    with pytest.raises(ZerorunError, match=rf"^checkpoint.dir {default} holds 2 checkpoints of an earlier job "
                                           rf"\(step-00000030 the latest\): this job resumes from {elsewhere} and "
                                           "would save beside them, replacing"):
        check_save_folder(r)
    # what may go on: continuing the folder's job, from its latest or an older step of it; a job that saves
    # nothing; a folder of its own, holding no checkpoint or only unfinished saves
    os.symlink(default / "step-00000030", tmp_path / "best")  # a link kept outside the folder (found by review)
    for resume in (str(default / "step-00000030"), str(default / "step-00000020"), str(tmp_path / "best")):
        r = load_recipe(TINY, fresh)
        r.checkpoint.resume = resume
        check_save_folder(r)
    assert prepare_resume(load_recipe(TINY, [f"log.dir={tmp_path}"]), None)
    (tmp_path / "unfinished" / "step-00000050").mkdir(parents=True)  # no marker: not complete
    for folder, resume in ((tmp_path / "new", None), (tmp_path / "new", elsewhere), (other, elsewhere),
                           (tmp_path / "unfinished", None)):
        r = load_recipe(TINY, [*fresh, f"checkpoint.dir={folder}"])
        r.checkpoint.resume = resume
        check_save_folder(r)
    r = load_recipe(TINY, [*fresh, f"checkpoint.dir={tmp_path / 'unfinished'}"])
    assert prepare_resume(r, LATEST) and r.checkpoint.resume is None  # none to continue: step 0, saving there
    # the folder it suggests is free (found by review: "-2", taken by the first one who followed the advice)
    _complete(tmp_path / "tiny" / "checkpoints-2", 10, 4.0)
    with pytest.raises(ZerorunError) as e:
        prepare_resume(load_recipe(TINY, [*fresh, f"checkpoint.dir={default}-2"]), None)
    assert str(e.value) == (
        f"checkpoint.dir {default}-2 holds a checkpoint of an earlier job (step-00000010): a new job would save beside "
        "it, replacing and pruning it (checkpoint.keep 2). Continue that job with --resume, give this one a folder of "
        f"its own (checkpoint.dir={default}-2-2), or remove it first")
    with pytest.raises(ZerorunError, match=r"\(checkpoint\.dir=.*/checkpoints-3\)"):
        prepare_resume(load_recipe(TINY, fresh), None)


def test_a_step_folder_holding_what_no_save_writes_is_not_replaced(tmp_path):
    """A review: a save of step 10 removed a user's notes kept in step-00000010 without a word (exit 0), and a file
    of that name was replaced, its set-aside copy left behind. Refused before the job now, for the steps it would
    save or prune only (a review of the first version refused a resume beside a file consolidated into an older
    step the job would never touch). A save's own names (an unfinished save's) may go."""
    folder = tmp_path / "ckpt"
    (folder / "step-00000020").mkdir(parents=True)
    for name in (".metadata", "__0_0.distcp", "__1_0.distcp", "zerorun.json"):  # a save cut before its marker
        (folder / "step-00000020" / name).write_text("x")
    recipe = load_recipe(TINY, [f"checkpoint.dir={folder}", "checkpoint.every=10", "train.steps=40"])
    check_save_folder(recipe)
    (folder / "step-00000010").mkdir()
    (folder / "step-00000010" / "notes.txt").write_text("precious")
    with pytest.raises(ZerorunError) as e:
        check_save_folder(recipe)
    assert str(e.value) == (f"checkpoint.dir {folder}: step-00000010 holds notes.txt, which a save of that step would "
                            "replace (it holds what no checkpoint does): move it out, or give this job another "
                            "checkpoint.dir")
    (folder / "step-00000050").write_text("x")  # past train.steps: never saved
    (folder / "step-00000010" / "notes.txt").unlink()
    (folder / "step-00000010").rmdir()
    (folder / "step-00000010").write_text("x")
    with pytest.raises(ZerorunError, match=r"step-00000010 is a file, which a save of that step would replace"):
        check_save_folder(recipe)
    # resumed from step 30 of this folder: steps 5, 10 and 20 are neither saved again nor pruned (keep 10)
    (folder / "step-00000010").unlink()
    done = _complete(folder, 30, 1.0)
    (folder / "step-00000005").mkdir()
    (folder / "step-00000005" / "model.safetensors").write_text("x")  # zerorun consolidate's output, kept there
    resumed = load_recipe(TINY, [f"checkpoint.dir={folder}", "checkpoint.every=10", "train.steps=40",
                                 "checkpoint.keep=10"])
    resumed.checkpoint.resume = done
    check_save_folder(resumed)
    resumed.checkpoint.keep = 1  # step 40's save prunes every older complete one, step 5 not among them
    check_save_folder(resumed)
    (folder / "step-00000030" / "notes.txt").write_text("x")
    with pytest.raises(ZerorunError, match=r"step-00000030 holds notes\.txt, which checkpoint\.keep 1 would prune"):
        check_save_folder(resumed)
