"""The validation loss is the exact mean over every validation sample once (zerorun/rank/data.py eval_batches and
the worker's evaluate), with the sample count: no duplicates padding the last batch, dict batches counted by
their size, every rank running the same number of forwards (stage 3's are collective)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from zerorun.rank.data import eval_batches


@pytest.mark.parametrize("n,world,mb,limit", [(5, 2, 2, 8), (1, 2, 2, 8), (9, 4, 2, 8), (100, 3, 4, 9),
                                              (7, 3, 1, 8), (6, 2, 3, 8)])
def test_every_sample_once_and_the_same_number_of_batches(n, world, mb, limit):
    plans = [eval_batches(n, r, world, mb, limit) for r in range(world)]
    assert len({len(p) for p in plans}) == 1 and all(len(b) <= mb for p in plans for b in p)
    assert sorted(i for p in plans for b in p for i in b) == list(range(n))


def test_a_batch_limit_evaluates_that_many_full_batches_per_rank():
    plans = [eval_batches(100, r, 2, 4, 3) for r in range(2)]
    assert [len(p) for p in plans] == [3, 3] and sum(len(b) for p in plans for b in p) == 24


DATA = """\
import torch
from torch.utils.data import Dataset


class Values(Dataset):
    def __init__(self, values):
        self.values = values

    def __len__(self):
        return len(self.values)

    def __getitem__(self, i):
        return {"v": torch.tensor(float(self.values[i])), "i": torch.tensor(i)}


def build_data():
    return Values([1.0] * 8), Values([0.0, 1.0, 2.0, 3.0, 4.0])  # validation: true mean 2.0 over 5 samples
"""

MODEL = """\
import torch
import torch.nn as nn


class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Linear(1, 1)

    def forward(self, batch):  # each sample's loss is its value: the validation loss is the values' mean
        return (batch["v"] + 0.0 * self.w.weight.sum()).mean()


def build_model():
    return M()
"""


@pytest.mark.slow
def test_validation_loss_is_the_mean_over_every_sample_once(tmp_path):
    """5 samples on 2 ranks with micro-batch 2 at stage 3: was 1.75 over "4 samples" (a duplicate padded in,
    each dict batch counted as one sample)."""
    (tmp_path / "data.py").write_text(DATA)
    (tmp_path / "model.py").write_text(MODEL)
    (tmp_path / "r.yaml").write_text(textwrap.dedent(f"""\
        name: evalmean
        model: {{module: {tmp_path / 'model.py'}}}
        data: {{kind: module, module: {tmp_path / 'data.py'}, factory: build_data}}
        train: {{steps: 1, micro_batch_size: 2, eval_every: 1}}
        zero: {{stage: 3}}
        launch: {{procs_per_node: 2}}
        log: {{every: 1, dir: {tmp_path / 'runs'}}}
        """))
    out = subprocess.run([sys.executable, "-m", "zerorun", "train", str(tmp_path / "r.yaml"), "--no-dashboard"],
                         cwd=str(tmp_path), capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    [metrics] = list((tmp_path / "runs").glob("*/*/metrics.jsonl"))
    evals = [json.loads(line) for line in metrics.read_text().splitlines() if '"eval"' in line]
    evals = [e for e in evals if e["event"] == "eval"]
    assert [(e["step"], e["val_loss"], e["samples"]) for e in evals] == [(0, 2.0, 5), (1, 2.0, 5)], evals
