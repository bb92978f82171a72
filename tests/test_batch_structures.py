"""A user's own data and model as a plain loop, DeepSpeed or accelerate take them (a review of the data path): the
structures a micro-batch comes in (Note [Batch structures] in zerorun/zero/trees.py), one module per file (Note
[One module per file] in zerorun/rank/userload.py), the data after the model's random draws at every stage (Note
[Data after the model's random draws] in zerorun/rank/loop.py), and one line for what cannot train."""

from __future__ import annotations

import collections
import dataclasses
import json
import subprocess
import sys
import textwrap
import types

import pytest
import torch

from zerorun.rank.data import build_datasets, stacked, to_device, tokens_in
from zerorun.rank.userload import UserCodeError, call_factory, extract_loss, load_module
from zerorun.recipe import DataSpec

Pair = collections.namedtuple("Pair", "x y")


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    y: torch.Tensor
    note: str = "kept"


@dataclasses.dataclass(frozen=True)
class Frozen:
    x: torch.Tensor


class Encoding(collections.UserDict):
    """As transformers' ``BatchEncoding``: a ``UserDict`` with state of its own."""

    def __init__(self, data=None, n_sequences=None):
        super().__init__(data)
        self.n_sequences = n_sequences


class TopLevelOnly(collections.UserDict):
    """As transformers' ``BatchEncoding``: a mapping whose own ``.to`` moves its top-level tensors only, in place."""

    def to(self, device):
        self.data = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in self.data.items()}
        return self


class Moves:
    """An object of the user's with a ``.to`` of its own."""

    def __init__(self, t):
        self.t = t

    def to(self, device):
        return Moves(self.t.to(device, dtype=torch.float64))


def test_every_container_of_a_batch_keeps_its_type_on_the_device():
    """A named tuple was rebuilt as ``type(batch)(generator)``: a TypeError on the rank. Each container now keeps its
    type and state, the tensors moved (here: cast, to see that each was reached)."""
    x, y = torch.ones(2, 3), torch.zeros(2)
    batches = [Pair(x, y), Batch(x, y), Frozen(x), Encoding({"input_ids": x}, n_sequences=1),
               collections.defaultdict(list, {"x": [x, (y,)]}), collections.OrderedDict(x=x),
               types.MappingProxyType({"x": x}), [Pair(x, y), {"x": x}]]
    moved = [to_device(b, torch.device("cpu")) for b in batches]
    double = [_cast(b) for b in batches]
    pair, batch, frozen, encoding, default, ordered, proxy, nested = double
    assert type(pair) is Pair and pair.y is not y and torch.equal(pair.x, x.double())
    assert type(batch) is Batch and batch.note == "kept" and batch.x.dtype == torch.float64
    assert type(frozen) is Frozen and frozen.x.dtype == torch.float64
    assert type(encoding) is Encoding and encoding.n_sequences == 1 and encoding["input_ids"].dtype == torch.float64
    assert type(default) is collections.defaultdict and default.default_factory is list
    assert default["x"][1][0].dtype == torch.float64 and type(ordered) is collections.OrderedDict
    assert type(proxy) is dict and proxy["x"].dtype == torch.float64  # a read-only mapping becomes a dict
    assert type(nested[0]) is Pair and nested[1]["x"].dtype == torch.float64
    assert batches[1].x.dtype == torch.float32  # the batch itself is not changed
    assert [type(m) for m in moved] == [type(b) for b in batches[:6]] + [dict, list]
    assert to_device(Moves(x), torch.device("cpu")).t.dtype == torch.float64  # its own .to, as accelerate calls
    # a review: a PackedSequence (a named tuple with a .to of its own) was rebuilt field by field, its
    # batch_sizes moved too (ValueError off the CPU); the meta device stands for a GPU here
    packed = torch.nn.utils.rnn.pack_sequence([torch.ones(3, 2), torch.ones(2, 2)])
    moved = to_device({"seq": packed}, torch.device("meta"))["seq"]
    assert type(moved) is type(packed) and moved.data.is_meta and moved.batch_sizes.device.type == "cpu"
    # a review of that: a BatchEncoding was handed to its own .to, which left its nested tensors on the CPU and
    # changed the user's batch in place; a mapping is walked
    encoding = TopLevelOnly({"input_ids": x, "pixels": [y], "extra": {"m": y}})
    moved = to_device(encoding, torch.device("meta"))
    assert type(moved) is TopLevelOnly and moved["pixels"][0].is_meta and moved["extra"]["m"].is_meta
    assert not encoding["input_ids"].is_meta


def _cast(batch):
    from zerorun.zero.trees import map_tensors

    return map_tensors(lambda t: t.double(), batch)


DATA = textwrap.dedent("""\
    import collections
    import dataclasses

    import torch
    from torch.utils.data import Dataset, IterableDataset

    Pair = collections.namedtuple("Pair", "x y")


    @dataclasses.dataclass
    class Sample:
        x: torch.Tensor


    class Samples(Dataset):
        def __init__(self, make):
            self.make = make

        def __len__(self):
            return 4

        def __getitem__(self, i):
            return self.make(i)


    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(4))

        def __len__(self):
            return 4


    def dataclasses_():
        return Samples(lambda i: Sample(torch.ones(2)))


    def stream():
        return Stream()


    def exits():
        raise SystemExit(2)


    def as_dataclass(samples):
        return Sample(torch.stack([s.x for s in samples]))


    def as_encoding(samples):
        return collections.UserDict({"x": torch.stack([s.x for s in samples])})


    class Holder:
        def __init__(self):
            self.x = torch.ones(2)


    def as_object(samples):
        return Holder()
    """)


@pytest.fixture
def module(tmp_path):
    path = tmp_path / "datamod.py"
    path.write_text(DATA)
    return str(path)


def test_a_collate_may_return_a_dataclass_or_a_mapping(module):
    """Both hold tensors; they were refused as 'not a batch holding tensors' (torch's pytree knows neither)."""
    train, _, _ = build_datasets(DataSpec(kind="module", module=module, factory="dataclasses_"))
    samples = [train[i] for i in range(2)]
    for name in ("as_dataclass", "as_encoding"):
        _, _, collate = build_datasets(DataSpec(kind="module", module=module, factory="dataclasses_", collate=name))
        assert torch.equal(collate(samples)["x"] if name == "as_encoding" else collate(samples).x, torch.ones(2, 2))


def test_a_collate_returning_what_cannot_be_moved_is_one_line(module):
    """A review: a plain object holding tensors as attributes passed the check (its tensors found) but was not
    moved to the device (a device mismatch in forward on a GPU); before the first fix it was refused in one line."""
    _, _, collate = build_datasets(DataSpec(kind="module", module=module, factory="dataclasses_", collate="as_object"))
    with pytest.raises(UserCodeError, match=r"data\.collate 'as_object' returned Holder, an object whose tensors "
                                            r"zerorun cannot move to the device: return tuples, lists, dicts or "
                                            r"dataclasses of tensors, or give it a \.to\(device\) method$"):
        collate([])


def test_samples_torch_cannot_collate_and_an_iterable_dataset_are_one_line_each(module):
    """Dataclass samples without data.collate were told to have 'one shape'; an IterableDataset with a __len__ got
    torch's DataLoader error naming zerorun's sampler (without one: already one line)."""
    train, _, _ = build_datasets(DataSpec(kind="module", module=module, factory="dataclasses_"))
    with pytest.raises(UserCodeError, match=r"^data: samples of type Sample cannot be made into a micro-batch by "
                                            r"torch's default collate .*in data\.collate$"):
        stacked([train[0], train[1]])
    with pytest.raises(UserCodeError, match=r"stream\(\) returned a Stream \(an IterableDataset\) as the train set, "
                                            r"not a map-style Dataset"):
        build_datasets(DataSpec(kind="module", module=module, factory="stream"))
    with pytest.raises(UserCodeError, match=r"raised SystemExit: 2 \(a factory that parses the command line or "
                                            r"exits cannot build the data here\)$"):
        build_datasets(DataSpec(kind="module", module=module, factory="exits"))


def test_only_integer_sequences_count_as_tokens():
    """A regression's float features showed as tokens per second (and FLOPs); an (inputs, labels) pair, a dict's
    input_ids, a named tuple, a BatchEncoding-like mapping count their ids."""
    ids, features, labels = torch.zeros(4, 16, dtype=torch.long), torch.zeros(4, 8), torch.zeros(4)
    for batch in (ids, (ids, labels), [ids, labels], {"input_ids": ids, "x": labels}, {"x": ids}, Pair(ids, labels),
                  Encoding({"mask": torch.ones(4, 16, dtype=torch.bool), "ids": ids}), (features, ids)):
        assert tokens_in(batch, next_token=False) == 64, type(batch)
    assert tokens_in({"input_ids": ids}, next_token=True) == 60
    mask = torch.ones(4, 16, dtype=torch.long)  # a BatchEncoding's input_ids, whatever comes first (a review)
    assert tokens_in(Encoding({"attention_mask": mask, "input_ids": ids[:, :8]}), next_token=False) == 32
    for batch in ((labels,), (features, labels), {"x": features}, torch.zeros(4, 3, 8, 8)):
        assert tokens_in(batch, next_token=False) == 0


def test_a_file_is_one_module_whichever_field_or_import_names_it(tmp_path):
    """model.module and data.module naming one file executed it twice per rank: state the data factory set was
    missing in the model's copy. The user's own `import helpers` now finds the same module too."""
    (tmp_path / "helpers.py").write_text("STATE = {}\n")
    (tmp_path / "both.py").write_text("import helpers\nSTATE = {}\n\ndef make():\n    STATE['scale'] = 2.0\n"
                                      "    return helpers\n")
    both = load_module(str(tmp_path / "both.py"))
    assert load_module(str(tmp_path / ".." / tmp_path.name / "both.py")) is both  # another spelling of the path
    call_factory(str(tmp_path / "both.py"), "make", {}, field="data.kwargs")
    assert load_module(str(tmp_path / "both.py")).STATE == {"scale": 2.0}
    assert load_module(str(tmp_path / "helpers.py")) is both.helpers  # imported by the user's code first
    (tmp_path / "user.py").write_text("import both\n")  # the user's own import of a file zerorun loaded
    assert load_module(str(tmp_path / "user.py")).both is both
    (tmp_path / "both.py").write_text("STATE = {'new': 1}\n")  # changed since: executed again
    assert load_module(str(tmp_path / "both.py")).STATE == {"new": 1}


def test_a_reload_of_a_loaded_file_runs_it_again(tmp_path):
    """A review: after the user's own import of a file zerorun loaded, importlib.reload returned it unchanged."""
    import importlib

    (tmp_path / "reloaded.py").write_text("VERSION = 1\n")
    (tmp_path / "uses.py").write_text("import reloaded\n")
    module = load_module(str(tmp_path / "reloaded.py"))
    assert load_module(str(tmp_path / "uses.py")).reloaded is module
    (tmp_path / "reloaded.py").write_text("VERSION = 2\n")
    assert importlib.reload(module) is module and module.VERSION == 2


def test_a_sibling_folders_import_of_the_same_name_gets_its_own_file(tmp_path):
    """A review of the first version, which registered a loaded file under its plain name: model.module a/net.py,
    and b/data.py's `import net` (b/net.py) got a's."""
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "netx.py").write_text(f"WHO = {folder!r}\n")
    (tmp_path / "b" / "datax.py").write_text("import netx\n")
    assert load_module(str(tmp_path / "a" / "netx.py")).WHO == "a"
    assert load_module(str(tmp_path / "b" / "datax.py")).netx.WHO == "b"


def test_a_loss_that_needs_no_gradient_names_the_model_file():
    """torch's 'element 0 of tensors does not require grad' named neither the file nor the cause."""
    w = torch.nn.Parameter(torch.ones(2))
    with pytest.raises(UserCodeError, match=r"^m\.py: forward's loss does not depend on any trainable parameter"):
        extract_loss((w * 2).sum().detach(), "m.py")
    assert extract_loss({"loss": (w * 2).sum()}, "m.py").requires_grad
    with torch.no_grad():  # evaluation: no gradient wanted
        assert not extract_loss((w * 2).sum(), "m.py").requires_grad


BOTH = textwrap.dedent("""\
    import collections

    import torch
    from torch.utils.data import Dataset

    Pair = collections.namedtuple("Pair", "x y")
    STATE = {}


    class Data(Dataset):
        def __init__(self, n):
            self.x, self.y = torch.randn(n, 6), torch.randn(n)  # the global generator, after the model's draws

        def __len__(self):
            return len(self.y)

        def __getitem__(self, i):
            return Pair(self.x[i], self.y[i])


    def make():
        STATE["scale"] = 0.5
        return Data(16)


    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([torch.nn.Linear(6, 6), torch.nn.Linear(6, 1)])

        def forward(self, batch):
            h = torch.tanh(self.layers[0](batch.x)) * STATE["scale"]
            return (self.layers[1](h).squeeze(-1) - batch.y).pow(2).mean()


    def build():
        return M()
    """)


@pytest.mark.slow
def test_one_file_for_model_and_data_trains_alike_at_stages_0_and_3(tmp_path):
    """The review's three faults in one job: named-tuple samples (a TypeError on the rank), model and data in one
    file whose module-level state the forward reads (a KeyError), and a data factory drawing random numbers (other
    data at stage 3 with zero.meta_init). Stage 3 now trains on stage 0's data to stage 0's losses."""
    (tmp_path / "both.py").write_text(BOTH)
    (tmp_path / "r.yaml").write_text(textwrap.dedent(f"""\
        name: both
        model: {{module: {tmp_path / 'both.py'}, factory: build}}
        data: {{kind: module, module: {tmp_path / 'both.py'}, factory: make}}
        train: {{steps: 3, micro_batch_size: 2, optimizer: {{name: SGD, lr: 0.1}}}}
        launch: {{procs_per_node: 2}}
        log: {{every: 1, dir: {tmp_path / 'runs'}}}
        """))
    losses = {}
    for stage in (0, 3):
        out = subprocess.run([sys.executable, "-m", "zerorun", "train", str(tmp_path / "r.yaml"), "--no-dashboard",
                              f"zero.stage={stage}", f"name=s{stage}"], cwd=str(tmp_path), capture_output=True,
                             text=True, timeout=240)
        assert out.returncode == 0, out.stdout + out.stderr
        [metrics] = list((tmp_path / "runs" / f"s{stage}").glob("*/metrics.jsonl"))
        events = [json.loads(line) for line in metrics.read_text().splitlines()]
        losses[stage] = [e["loss"] for e in events if e["event"] == "step" and e["rank"] == 0]
    assert len(losses[0]) == 3
    assert losses[3] == pytest.approx(losses[0], rel=1e-5)


def test_a_built_in_module_is_not_taken_for_a_loaded_file_of_its_name(tmp_path):
    """A review: the finder of loaded files came first on sys.meta_path, so a user file named like a built-in module
    not yet imported (pwd.py, gc.py) replaced that module for every later `import`; Python itself finds the
    built-in first."""
    import sys

    name = next(m for m in sys.builtin_module_names if m not in sys.modules and m.isidentifier())
    (tmp_path / f"{name}.py").write_text("WHO = 'user'\n")
    assert load_module(str(tmp_path / f"{name}.py")).WHO == "user"
    imported = __import__(name)
    assert not hasattr(imported, "WHO") and imported.__spec__.origin == "built-in", imported
