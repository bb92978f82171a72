"""Training data: built-in byte-level text windows, or a user factory returning datasets; the stream of
micro-batches a rank trains on, resumable at a checkpoint's data position."""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any, Callable, Iterator

import torch
from torch.utils.data import Dataset, IterableDataset, default_collate

from zerorun.recipe import DataSpec, expand_data_paths
from zerorun.rank.userload import UserCodeError, call_factory, load_module, raised_at
from zerorun.zero.trees import map_tensors, tensors_in


class ByteWindows(Dataset):
    """Non-overlapping windows over a byte string: item ``i`` is ``tokens[i*T : i*T + T + 1]`` as int64,
    shape ``(T + 1,)`` (inputs and next-byte targets), vocabulary 256.

    Args:
        tokens: uint8 tensor, shape ``(n,)``.
        seq_len: ``T``, tokens per sample.
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int) -> None:
        self.tokens = tokens
        self.seq_len = seq_len

    def __len__(self) -> int:
        return max(0, (len(self.tokens) - 1) // self.seq_len)

    def __getitem__(self, i: int) -> torch.Tensor:
        if not 0 <= i < len(self):
            raise IndexError(i)
        start = i * self.seq_len
        return self.tokens[start:start + self.seq_len + 1].long()


def eval_batches(n: int, rank: int, world_size: int, micro_batch_size: int, max_batches: int) -> list[list[int]]:
    """This rank's validation micro-batches, as lists of sample indices into a set of ``n`` samples.

    Rank ``r`` takes samples ``r, r + N, r + 2N, ...`` (``N = world_size``), so that over all ranks every sample
    is evaluated exactly once (no padding with duplicates, as ``DistributedSampler`` does), in at most
    ``max_batches`` micro-batches of ``micro_batch_size``. Every rank gets the same number of batches (a
    stage-3 forward is collective): a rank with fewer samples gets empty lists at the end, to run a forward
    that counts for nothing.
    """
    mine = list(range(rank, n, world_size))
    count = min(max_batches, -(-(-(-n // world_size)) // micro_batch_size))
    return [mine[i * micro_batch_size:(i + 1) * micro_batch_size] for i in range(count)]


def read_corpus(patterns: list[str]) -> torch.Tensor:
    """The bytes of every file matched by ``patterns`` (see :func:`zerorun.recipe.expand_data_paths`),
    concatenated in path order: uint8 tensor, shape ``(total bytes,)``."""
    chunks = []
    for path in expand_data_paths(patterns):
        with open(path, "rb") as f:
            chunks.append(f.read())
    data = bytearray(b"".join(chunks))
    if not data:  # torch.frombuffer refuses an empty buffer
        raise UserCodeError(f"data.paths: the files matched ({', '.join(expand_data_paths(patterns))}) are empty")
    return torch.frombuffer(data, dtype=torch.uint8)


def build_datasets(spec: DataSpec, progress=None) -> tuple[Dataset, Dataset | None, Callable[[list], Any]]:
    """``(train, validation or None, collate)`` for a recipe's ``data`` section: ``collate(samples)`` makes a
    micro-batch of a list of samples (:func:`collate_of`).

    ``text``: the last ``val_fraction`` of the corpus's bytes is the validation split.
    ``module``: ``factory(**kwargs)`` returns a Dataset or a ``(train, val)`` pair.
    ``hf``: tokenized blocks (zerorun/hf/data.py), ``progress(message)`` called while tokenizing.

    Raises:
        UserCodeError: the data factory fails or returns something that is not a Dataset; no ``data.collate``.
    """
    if spec.kind == "hf":
        import os

        from zerorun.hf.data import build_hf_datasets

        return *build_hf_datasets(spec, progress, local_rank=int(os.environ.get("LOCAL_RANK", 0))), stacked
    if spec.kind == "text":
        tokens = read_corpus(spec.paths)
        n_val = int(len(tokens) * spec.val_fraction)
        train = ByteWindows(tokens[:len(tokens) - n_val], spec.seq_len)
        val = ByteWindows(tokens[len(tokens) - n_val:], spec.seq_len) if n_val > spec.seq_len else None
        return train, val, stacked
    module = load_module(spec.module)
    out: Any = call_factory(spec.module, spec.factory, spec.kwargs, module=module, field="data.kwargs")
    train, val = out if isinstance(out, tuple) and len(out) == 2 else (out, None)
    for what, ds in (("train", train), ("validation", val)):
        wrong = _not_a_dataset(ds) if ds is not None or what == "train" else None
        if wrong:
            raise UserCodeError(f"{spec.module}: {spec.factory}() returned {wrong} as the {what} set, not a "
                                "map-style Dataset (return a Dataset, or a tuple (train, validation))")
    return train, val, collate_of(spec, module)


def check_sizes(spec: DataSpec, train, val, world_size: int, t) -> str | None:
    """Check that ``train`` fills one micro-batch on every rank (``t``: the recipe's ``train``); a note when
    ``train.eval_every`` asks for validation and there is no validation sample (None: nothing to say).

    Raises:
        UserCodeError: too few training samples, naming the data's source.
    """
    source = f" ({spec.module}: {spec.factory}())" if spec.kind == "module" else ""
    if len(train) < world_size * t.micro_batch_size:
        raise UserCodeError(f"data{source}: {len(train)} training samples, fewer than one micro-batch on every rank "
                            f"({world_size} ranks x {t.micro_batch_size})")
    if not t.eval_every or (val is not None and len(val) > 0):
        return None
    why = f"{spec.factory}() returned no validation set" if spec.kind == "module" else \
        f"data.val_fraction {spec.val_fraction} of the data holds no sample of data.seq_len {spec.seq_len}"
    return f"note: train.eval_every {t.eval_every}, but no validation sample ({why}): no validation loss"


def collate_of(spec: DataSpec, module: Any) -> Callable[[list], Any]:
    """``data.collate``, the function of ``module`` (``data.module``) that makes a micro-batch of a list of samples
    (a DataLoader's ``collate_fn``: padding samples of different lengths), else :func:`stacked`.

    Raises:
        UserCodeError: ``module`` has no such function.
    """
    if spec.collate is None:
        return stacked
    fn, where = getattr(module, spec.collate, None), f"{spec.module}: data.collate {spec.collate!r}"
    if fn is None or isinstance(fn, type) or not callable(fn):
        what = "not in the module" if fn is None else "a class: name a function, or an instance made in the " \
            "module (a collator object)" if isinstance(fn, type) else f"{type(fn).__name__} {fn!r}, not a function"
        raise UserCodeError(f"{where} is {what}")

    def collate(samples: list) -> Any:
        try:
            batch = fn(samples)
        except Exception as e:  # noqa: BLE001 - the user's function: one line naming it, its file and line
            frame = raised_at(e)  # the user's line, not torch's below it (a torch.stack in the function)
            at = f" (at {frame.filename}:{frame.lineno} in {frame.name})" if frame else ""
            raise UserCodeError(f"{where} raised {type(e).__name__}: {e}{at}") from None
        if not tensors_in(batch, attributes=False):  # Note [Batch structures]: a dataclass, a BatchEncoding too
            held = ("an object whose tensors zerorun cannot move to the device: return tuples, lists, dicts or "
                    "dataclasses of tensors, or give it a .to(device) method") if tensors_in(batch) else \
                "not a batch holding tensors"  # a plain object's attributes are not walked by to_device
            raise UserCodeError(f"{where} returned {type(batch).__name__}, {held}")
        return batch

    return collate


def stacked(samples: list) -> Any:
    """torch's ``default_collate`` of ``samples`` (tensors of one shape stacked, dicts and tuples field by field).

    Raises:
        UserCodeError: they cannot be stacked (samples of different shapes): one line, not torch's traceback.
    """
    try:
        return default_collate(samples)
    except (RuntimeError, TypeError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        if isinstance(e, TypeError) and "default_collate" in reason:  # a sample type it does not know (a dataclass)
            raise UserCodeError(f"data: samples of type {type(samples[0]).__name__} cannot be made into a "
                                "micro-batch by torch's default collate (tensors, numbers, dicts, lists and tuples of "
                                "them): name a function of data.module that batches them in data.collate") from None
        raise UserCodeError(f"data: {len(samples)} samples cannot be stacked into one micro-batch ({reason}): give "
                            "samples of one shape, or name a function of data.module that pads them in "
                            "data.collate") from None


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` with every tensor in it on ``device`` (``non_blocking``: asynchronous from pinned memory), its
    containers' types kept (Note [Batch structures] in zero/trees.py); an object with a ``.to`` method of its own
    that is no mapping (``PackedSequence``) is moved by it, as accelerate's ``send_to_device`` does."""
    return map_tensors(lambda t: t.to(device, non_blocking=True), batch, lambda obj: obj.to(device))


def tokens_in(batch: Any, next_token: bool) -> int:
    """The tokens of a micro-batch, for its throughput: the elements of its ``input_ids`` (a mapping's), else of
    its first integer tensor of two or more dimensions (batch x sequence); 0 where it holds none (a regression's
    float features, an image batch, are not tokens). ``next_token`` (text and Hugging Face data): each sequence of
    ``T + 1`` ids trains ``T`` targets."""
    ids = batch.get("input_ids") if isinstance(batch, Mapping) else None
    if not isinstance(ids, torch.Tensor):
        ids = next((t for t in tensors_in(batch) if t.dim() >= 2 and not (
            t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)), None)
    if ids is None or ids.dim() < 2:
        return 0
    return ids.shape[0] * (ids.shape[1] - 1 if next_token else ids.shape[1])


def _not_a_dataset(ds: Any) -> str | None:
    """What ``ds`` is when it is not a map-style dataset (``None``, text, an object without ``__len__`` and
    ``__getitem__``, a list or tuple of datasets rather than of samples), else ``None``."""
    if isinstance(ds, IterableDataset):  # its len() does not make it indexable (DataLoader refuses a sampler)
        return f"a {type(ds).__name__} (an IterableDataset)"
    if ds is None or isinstance(ds, (str, bytes, dict)):  # a dict: of columns, most often (zip them into samples)
        return repr(ds) if ds is None else f"a {type(ds).__name__}"
    if not (hasattr(ds, "__getitem__") and hasattr(ds, "__len__")):
        return f"a {type(ds).__name__}"
    try:
        len(ds)
    except Exception as e:  # noqa: BLE001 - the user's __len__ (negative, not an int)
        return f"a {type(ds).__name__} whose len() raised {type(e).__name__}: {e}"
    if isinstance(ds, (list, tuple)) and ds and all(isinstance(d, Dataset) for d in ds):
        return f"a {type(ds).__name__} of {len(ds)} Datasets"
    return None


class _SkipSampler(torch.utils.data.Sampler):
    """``sampler``'s indices without the first ``skip``."""

    def __init__(self, sampler, skip: int) -> None:
        self.sampler, self.skip = sampler, skip

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(iter(self.sampler), self.skip, None)

    def __len__(self) -> int:
        return max(0, len(self.sampler) - self.skip)


def batch_stream(dataset, sampler, micro_batch_size: int, position, collate=stacked) -> Iterator[Any]:
    """Endless micro-batches of ``micro_batch_size`` samples from ``dataset``, made by ``collate``
    (:func:`collate_of`), in ``sampler``'s order (a ``DistributedSampler``: ``set_epoch`` is called at each epoch),
    starting at ``position`` (a :class:`zerorun.checkpoint.DataPosition`), which is kept up to date as batches are
    yielded (Note [Exact resume] in checkpoint/saving.py)."""
    from torch.utils.data import DataLoader

    generator = torch.Generator()  # the loader's own: making its iterator draws no global random number
    skip = position.batch
    while True:
        sampler.set_epoch(position.epoch)
        loader = DataLoader(dataset, batch_size=micro_batch_size,
                            sampler=_SkipSampler(sampler, skip * micro_batch_size), drop_last=True, generator=generator,
                            collate_fn=collate)
        for batch in loader:
            position.batch += 1
            yield batch
        position.epoch += 1
        position.batch = skip = 0
