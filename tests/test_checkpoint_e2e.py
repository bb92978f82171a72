"""End to end: ``zerorun train`` saving checkpoints, killed in the middle of a save, resumed with
``--resume`` (latest) and ``--resume PATH`` at another stage, and ``zerorun consolidate``."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from parity_cases import rel
from test_train_e2e import ROOT, TINY, zerorun

pytestmark = pytest.mark.slow

# The tiny GPT, with a DCP writer that kills rank 1 (SIGKILL) right after it wrote its shards of the
# KILL_AT_SAVE-th checkpoint, while rank 0 waits to finish that save.
MODEL = f"""
import importlib.util, os, signal
import torch.distributed.checkpoint.filesystem as fs

_spec = importlib.util.spec_from_file_location("tiny_gpt", {os.path.join(ROOT, "recipes/models/gpt.py")!r})
_gpt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_gpt)
_write, _saves = fs.FileSystemWriter.write_data, [0]


def write_data(self, plan, planner):
    _saves[0] += 1
    result = _write(self, plan, planner)
    if os.environ["RANK"] == "1" and os.environ.get("KILL_AT_SAVE") == str(_saves[0]):
        os.kill(os.getpid(), signal.SIGKILL)
    return result


fs.FileSystemWriter.write_data = write_data
build_model = _gpt.build_model
"""


def losses(run_root, after: int = 0) -> dict[int, float]:
    out = {}
    for metrics in run_root.glob("*/*/metrics.jsonl"):
        for line in metrics.read_text().splitlines():
            e = json.loads(line)
            if e["event"] == "step" and e["rank"] == 0 and e["step"] > after:
                out[e["step"]] = e["loss"]
    return out


def started(*args: str, cwd: str):
    """Start ``zerorun *args`` in the background; return a function that waits for it (a CompletedProcess, as
    test_train_e2e's ``zerorun`` returns)."""
    proc = subprocess.Popen([sys.executable, "-m", "zerorun", *args], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)

    def wait() -> subprocess.CompletedProcess:
        out, err = proc.communicate(timeout=240)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    return wait


def test_kill_during_save_then_resume_exactly_and_at_another_stage(tmp_path):
    """Four jobs, two at a time (each pair does not depend on each other: a job uses about one of the machine's
    CPUs while it waits on its ranks' imports and collectives): the uninterrupted one and the killed one, then the
    killed one resumed and the uninterrupted one's step-6 checkpoint resumed at stage 1 (and the consolidation)."""
    (tmp_path / "model.py").write_text(MODEL)
    common = [f"model.module={tmp_path / 'model.py'}", "model.kwargs.dropout=0.1", "train.steps=8",
              "train.eval_every=0", "zero.stage=3", "checkpoint.every=3", "checkpoint.keep=3", "log.every=1"]

    def train(name: str, *extra: str):
        return started("train", TINY, *common, f"checkpoint.dir={tmp_path / name / 'ckpt'}",
                       f"log.dir={tmp_path / name / 'runs'}", *extra, cwd=ROOT)

    full, killed = train("full"), train("killed", 'launch.env.KILL_AT_SAVE="2"')
    full, killed = full(), killed()
    # uninterrupted: checkpoints after steps 3, 6 and 8
    assert full.returncode == 0, full.stdout + full.stderr
    assert sorted(os.listdir(tmp_path / "full" / "ckpt")) == ["step-00000003", "step-00000006", "step-00000008"]
    assert "checkpoint step 3: " in full.stdout
    reference = losses(tmp_path / "full" / "runs")
    assert sorted(reference) == list(range(1, 9))
    events = [json.loads(line) for line in next((tmp_path / "full" / "runs").glob("*/*/metrics.jsonl")).read_text()
              .splitlines()]
    saved = [e for e in events if e["event"] == "checkpoint"]
    assert [e["step"] for e in saved] == [3, 6, 8] and all(e["bytes"] > 0 and e["seconds"] > 0 for e in saved)

    # killed: rank 1 dies inside the save after step 6
    assert killed.returncode == 1 and "rank 1" in killed.stderr, killed.stdout + killed.stderr
    # launch.env values never reach the disk: masked in the run folder's recipe.yaml and in zerorun.json
    [recipe_copy] = (tmp_path / "killed" / "runs").glob("*/*/recipe.yaml")
    assert "KILL_AT_SAVE: <masked>" in recipe_copy.read_text()
    saved_recipe = json.loads((tmp_path / "killed" / "ckpt" / "step-00000003" / "zerorun.json").read_text())["recipe"]
    assert saved_recipe["launch"]["env"] == {"KILL_AT_SAVE": "<masked>"}
    left = sorted(os.listdir(tmp_path / "killed" / "ckpt"))
    assert len(left) == 2 and re.fullmatch(r"\.step-00000006\.[0-9a-f]{12}\.tmp", left[0]) \
        and left[1] == "step-00000003", left  # the save cut short, named by its job

    resumed = train("killed", "--resume")  # the latest complete checkpoint: step 3
    # saved at stage 3, resumed at stage 1 (same 2 ranks, same data order, same RNG states)
    other = train("stage1", "--resume", str(tmp_path / "full" / "ckpt" / "step-00000006"), "zero.stage=1")
    out = started("consolidate", str(tmp_path / "full" / "ckpt"), "--out", str(tmp_path / "model.safetensors"),
                  cwd=ROOT)
    resumed, other, out = resumed(), other(), out()
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resumed from " + str(tmp_path / "killed" / "ckpt" / "step-00000003") in resumed.stdout
    assert (f"zerorun: 1 unfinished save in {tmp_path / 'killed' / 'ckpt'} ignored: resuming from the latest complete "
            "checkpoint, step-00000003\n") in resumed.stdout, resumed.stdout
    after = {s: v for s, v in losses(tmp_path / "killed" / "runs").items() if s > 3}
    assert sorted(after) == [4, 5, 6, 7, 8]
    assert max(rel(after[s], reference[s]) for s in after) <= 1e-6, (after, reference)

    assert other.returncode == 0, other.stdout + other.stderr
    after = losses(tmp_path / "stage1" / "runs")
    assert sorted(after) == [7, 8] and max(rel(after[s], reference[s]) for s in after) <= 1e-5

    assert out.returncode == 0 and re.search(rf"wrote \d+ tensors \(.*\) of {tmp_path / 'full' / 'ckpt'}/step-\d{{8}} "
                                             rf"to {tmp_path / 'model.safetensors'}$", out.stdout), out.stdout
    spec = importlib.util.spec_from_file_location("gpt_for_test", os.path.join(ROOT, "recipes/models/gpt.py"))
    gpt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpt)
    model = gpt.build_model(vocab_size=256, n_layer=2, n_head=2, d_model=32, max_seq_len=32)
    model.load_state_dict(load_file(str(tmp_path / "model.safetensors")))
    assert all(p.dtype == torch.float32 for p in model.parameters())


@pytest.mark.parametrize("args,expected", [
    (["--resume", "runtime=ddp"], r"--resume: checkpoints are zerorun's \(runtime zero\); the ddp baseline"),
    (["--resume", "/no/such/ckpt"], r"/no/such/ckpt: no such checkpoint directory"),
    (["checkpoint.dir=/proc/zerorun-ckpt"], r"checkpoint\.dir: cannot create /proc/zerorun-ckpt: "),
])
def test_bad_resume_is_one_line_exit_2(args, expected):
    out = zerorun("train", TINY, *args, cwd=ROOT)
    assert out.returncode == 2 and re.search(expected, out.stderr), out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_consolidate_missing_dir_is_one_line_exit_2(tmp_path):
    out = zerorun("consolidate", str(tmp_path / "nope"), "--out", str(tmp_path / "m.pt"), cwd=ROOT)
    assert out.returncode == 2 and out.stderr.strip() == f"zerorun: error: {tmp_path / 'nope'}: no such checkpoint directory"


def _file_size_limit(nbytes: int):
    import resource

    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, nbytes))


def test_consolidate_output_errors_are_one_line_and_leave_nothing(tmp_path):
    """A review: a full disk (here: the file-size limit) was torch's or safetensors' traceback, exit 1, and left
    the temporary file; --max-shard-size was a traceback or ignored; a shard file was 'no such directory'."""
    out = zerorun("train", TINY, "train.steps=1", f"checkpoint.dir={tmp_path / 'ckpt'}", f"log.dir={tmp_path / 'runs'}",
                  cwd=ROOT)
    assert out.returncode == 0, out.stderr
    step = tmp_path / "ckpt" / "step-00000001"
    for name in ("m.safetensors", "m.pt"):
        target = tmp_path / "small" / name
        result = subprocess.run([sys.executable, "-m", "zerorun", "consolidate", str(step), "--out", str(target)],
                                cwd=ROOT, capture_output=True, text=True, timeout=120,
                                preexec_fn=_file_size_limit(4096))
        assert result.returncode == 2 and result.stderr.splitlines() == [
            f"zerorun: error: --out {target}: cannot write: File too large"], result.stderr
        assert os.listdir(tmp_path / "small") == []  # no temporary file left
    (tmp_path / "a-file").write_text("x")
    for args, line in (
            ([str(step / "zerorun.json"), "--out", "m.pt"],
             f"{step / 'zerorun.json'}: a file, not a checkpoint folder: give the step-N folder that holds it, or the "
             "folder of step-N folders"),
            ([str(step), "--out", str(tmp_path / "a-file" / "m.pt")],
             f"--out {tmp_path / 'a-file' / 'm.pt'}: cannot write: {tmp_path / 'a-file'} is a file, not a folder"),
            ([str(step), "--out", "m.pt", "--max-shard-size", "1KB"],
             "--max-shard-size 1KB: only with --hf (a .safetensors or .pt file is written whole)"),
            ([str(step), "--out", str(tmp_path / "hf"), "--hf", "--max-shard-size=-5MB"],
             "--max-shard-size -5MB: give a positive whole number and a unit, as 5GB, 500MB or 2GiB")):
        result = zerorun("consolidate", *args, cwd=ROOT)
        assert result.returncode == 2 and result.stderr.splitlines() == [f"zerorun: error: {line}"], result.stderr


def test_consolidate_of_a_job_that_saved_nothing_says_why(tmp_path):
    """A new user's review: `zerorun consolidate runs/gpt-stdlib/checkpoints` after the default job (which saves
    none) was 'no such checkpoint directory', and a run's own folder 'not a checkpoint', with no way on."""
    out = zerorun("consolidate", str(tmp_path / "checkpoints"), "--out", "m.pt", cwd=str(tmp_path))
    assert out.returncode == 2 and out.stderr.splitlines() == [
        f"zerorun: error: {tmp_path / 'checkpoints'}: no such checkpoint directory (a job saves checkpoints only "
        "with checkpoint.every or checkpoint.dir set)"], out.stderr
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    out = zerorun("consolidate", str(tmp_path / "run"), "--out", "m.pt", cwd=str(tmp_path))
    assert out.returncode == 2 and out.stderr.splitlines() == [
        f"zerorun: error: {tmp_path / 'run'}: not a checkpoint (no zerorun.json, .metadata or .distcp file in it) (a "
        f"run's folder: its checkpoints are in {tmp_path / 'run'}/checkpoints)"], out.stderr
