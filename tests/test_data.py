"""A recipe's training data as the ranks build it (zerorun/rank/data.py): what a ``data.module`` factory may
return, ``data.collate`` for samples of different shapes, and empty inputs; each wrong one a line naming the
module, factory or field. In-process, but for one 2-rank job."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from zerorun.errors import ZerorunError
from zerorun.rank.data import build_datasets, stacked
from zerorun.rank.userload import UserCodeError
from zerorun.recipe import DataSpec, load_recipe

DATA = textwrap.dedent("""\
    import torch
    from torch.utils.data import Dataset, TensorDataset


    class Ragged(Dataset):
        def __len__(self):
            return 12

        def __getitem__(self, i):  # lengths 3, 4, 5: one micro-batch cannot be stacked
            return {"x": torch.full((3 + i % 3,), float(i))}


    def pad(samples):
        width = max(len(s["x"]) for s in samples)
        return {"x": torch.stack([torch.nn.functional.pad(s["x"], (0, width - len(s["x"]))) for s in samples])}


    def ragged():
        return Ragged(), Ragged()


    def good():
        return TensorDataset(torch.arange(8.0)), TensorDataset(torch.arange(2.0))


    def returns(what):
        ds = TensorDataset(torch.arange(8.0))
        return {"none": None, "none_train": (None, ds), "text": "abc", "list": [ds, ds], "three": (ds, ds, ds),
                "columns": {"input_ids": [1, 2], "label": [0, 1]}, "negative": Negative()}[what]


    class Negative(Dataset):
        def __len__(self):
            return -1

        def __getitem__(self, i):
            return torch.zeros(2)


    def raises(samples):
        raise ValueError("my collate is broken")


    def nothing(samples):
        return None


    def arrays(samples):
        import numpy
        return {"x": numpy.zeros(2)}


    class Collator:
        def __call__(self, samples):
            return pad(samples)


    collator = Collator()
    forty_two = 42
    """)


@pytest.fixture
def module(tmp_path):
    path = tmp_path / "datamod.py"
    path.write_text(DATA)
    return str(path)


@pytest.mark.parametrize("what,wrong", [
    ("none", "None as the train set"), ("none_train", "None as the train set"), ("text", "a str as the train set"),
    ("list", "a list of 2 Datasets as the train set"), ("three", "a tuple of 3 Datasets as the train set"),
    ("columns", "a dict as the train set"),
    ("negative", "a Negative whose len() raised ValueError: __len__() should return >= 0 as the train set")])
def test_a_factory_that_returns_no_dataset_is_one_line(module, what, wrong):
    """A review: None was a TypeError traceback from len(); text passed and failed in the model's forward; a list
    [train, val] or a 3-tuple of datasets trained as a dataset of 2 or 3 'samples'."""
    spec = DataSpec(kind="module", module=module, factory="returns", kwargs={"what": what})
    with pytest.raises(UserCodeError) as e:
        build_datasets(spec)
    assert str(e.value) == (f"{module}: returns() returned {wrong}, not a map-style Dataset (return a Dataset, or "
                            "a tuple (train, validation))")
    train, val, collate = build_datasets(DataSpec(kind="module", module=module, factory="good"))
    assert (len(train), len(val)) == (8, 2) and collate is stacked


def test_kwargs_yaml_read_as_one_key_get_a_hint(module):
    """``data.kwargs={n:1}`` (no space) is YAML's key 'n:1' with no value: the message says how to write it."""
    with pytest.raises(UserCodeError, match=r"good\(\) does not take data\.kwargs \{'n:1': None\}: .*\(YAML reads "
                                            r"\{a:1\} as the key 'a:1': write \{a: 1\}\)$"):
        build_datasets(DataSpec(kind="module", module=module, factory="good", kwargs={"n:1": None}))


def test_samples_of_different_shapes_need_data_collate(module):
    """torch's collate error was a traceback naming neither the data nor the way out, and a recipe had no
    collate_fn to give (DeepSpeed and accelerate users pass one)."""
    train, val, collate = build_datasets(DataSpec(kind="module", module=module, factory="ragged"))
    with pytest.raises(UserCodeError, match=r"^data: 2 samples cannot be stacked into one micro-batch \(stack "
                                            r"expects each tensor to be equal size.*\): give samples of one shape, "
                                            r"or name a function of data\.module that pads them in data\.collate$"):
        collate([train[0], train[1]])
    train, val, collate = build_datasets(DataSpec(kind="module", module=module, factory="ragged", collate="pad"))
    assert torch.equal(collate([train[0], train[1]])["x"], torch.tensor([[0.0, 0, 0, 0], [1, 1, 1, 1]]))
    where = f"{module}: data.collate"
    for name, wrong in [("nope", "is not in the module"), ("forty_two", "is int 42, not a function"),
                        ("Collator", "is a class: name a function, or an instance made in the module (a collator "
                                     "object)")]:
        with pytest.raises(UserCodeError) as e:
            build_datasets(DataSpec(kind="module", module=module, factory="ragged", collate=name))
        assert str(e.value) == f"{where} {name!r} {wrong}"
    # a new user's review: each of these was a traceback blaming the model's forward, torch or zerorun
    for name, wrong in [("raises", f"raised ValueError: my collate is broken (at {module}:"),
                        ("nothing", "returned NoneType, not a batch holding tensors"),
                        ("arrays", "returned dict, not a batch holding tensors")]:
        train, val, collate = build_datasets(DataSpec(kind="module", module=module, factory="ragged", collate=name))
        with pytest.raises(UserCodeError) as e:
            collate([train[0], train[1]])
        assert str(e.value).startswith(f"{where} {name!r} {wrong}"), str(e.value)
    train, val, collate = build_datasets(DataSpec(kind="module", module=module, factory="ragged", collate="collator"))
    assert collate([train[1]])["x"].shape == (1, 4)


def test_data_collate_is_a_module_field_and_an_empty_text_corpus_is_one_line(tmp_path):
    recipe = tmp_path / "r.yaml"
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "m.py").write_text("")
    recipe.write_text("name: r\nmodel: {module: m.py}\ndata: {kind: text, paths: [empty.txt], collate: pad}\n"
                      "train: {steps: 1, micro_batch_size: 1}\n")
    with pytest.raises(ZerorunError, match=r"r\.yaml:3: data\.collate: a data\.kind 'module' field \(kind is "
                                           r"'text'\)$"):
        load_recipe(str(recipe), check_optimizer=False)
    # an empty file: torch.frombuffer's ValueError traceback on every rank before
    with pytest.raises(UserCodeError, match=r"^data\.paths: the files matched \(.*empty\.txt\) are empty$"):
        build_datasets(DataSpec(kind="text", paths=[str(tmp_path / "empty.txt")], seq_len=4))


def test_too_few_samples_name_the_factory_and_asking_for_no_validation_is_a_note(module):
    """A review: "data: 0 training samples" named no module; eval_every with a validation split too small for one
    sample (or a factory that returned none) ran without a validation loss and without a word."""
    from types import SimpleNamespace

    from zerorun.rank.data import check_sizes

    spec = DataSpec(kind="module", module=module, factory="good")
    train, val, _ = build_datasets(spec)
    with pytest.raises(UserCodeError, match=rf"^data \({module}: good\(\)\): 8 training samples, fewer than one "
                                            r"micro-batch on every rank \(2 ranks x 8\)$"):
        check_sizes(spec, train, val, 2, SimpleNamespace(micro_batch_size=8, eval_every=0))
    t = SimpleNamespace(micro_batch_size=2, eval_every=5)
    assert check_sizes(spec, train, val, 2, t) is None
    assert check_sizes(spec, train, None, 2, t) == ("note: train.eval_every 5, but no validation sample (good() "
                                                   "returned no validation set): no validation loss")
    text = DataSpec(kind="text", paths=["x"], seq_len=64, val_fraction=0.01)
    assert check_sizes(text, train, None, 2, t) == ("note: train.eval_every 5, but no validation sample "
                                                    "(data.val_fraction 0.01 of the data holds no sample of "
                                                    "data.seq_len 64): no validation loss")


MODEL = textwrap.dedent("""\
    import torch


    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Linear(5, 1)

        def forward(self, batch):
            x = torch.nn.functional.pad(batch["x"], (0, 5 - batch["x"].shape[1]))
            return self.w(x).pow(2).mean()


    def build_model():
        return M()
    """)


@pytest.mark.slow
def test_a_job_with_ragged_samples_trains_with_data_collate_and_stops_in_one_line_without(tmp_path, module):
    (tmp_path / "model.py").write_text(MODEL)
    (tmp_path / "r.yaml").write_text(textwrap.dedent(f"""\
        name: ragged
        model: {{module: {tmp_path / 'model.py'}}}
        data: {{kind: module, module: {module}, factory: ragged, collate: pad}}
        train: {{steps: 2, micro_batch_size: 2, eval_every: 2}}
        launch: {{procs_per_node: 2}}
        log: {{every: 1, dir: {tmp_path / 'runs'}}}
        """))

    def train(*overrides):
        return subprocess.run([sys.executable, "-m", "zerorun", "train", str(tmp_path / "r.yaml"), "--no-dashboard",
                               *overrides], cwd=str(tmp_path), capture_output=True, text=True, timeout=240)

    out = train()
    assert out.returncode == 0, out.stdout + out.stderr
    [metrics] = list((tmp_path / "runs").glob("*/*/metrics.jsonl"))
    events = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [e["samples"] for e in events if e["event"] == "eval"] == [12, 12]
    out = train("data.collate=null")
    [line] = out.stderr.strip().splitlines()
    assert out.returncode == 2 and line.startswith("zerorun: error: rank ") and (
        "give samples of one shape, or name a function of data.module that pads them in data.collate (logs: ") in line
