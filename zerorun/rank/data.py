"""Training data: built-in byte-level text windows, or a user factory returning datasets; the stream of
micro-batches a rank trains on, resumable at a checkpoint's data position."""

from __future__ import annotations

import itertools
from typing import Any, Iterator

import torch
from torch.utils.data import Dataset

from zerorun.recipe import DataSpec, expand_data_paths
from zerorun.rank.userload import UserCodeError, call_factory


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
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)


def build_datasets(spec: DataSpec, progress=None) -> tuple[Dataset, Dataset | None]:
    """``(train, validation or None)`` for a recipe's ``data`` section.

    ``text``: the last ``val_fraction`` of the corpus's bytes is the validation split.
    ``module``: ``factory(**kwargs)`` returns a Dataset or a ``(train, val)`` pair.
    ``hf``: tokenized blocks (zerorun/hf/data.py), ``progress(message)`` called while tokenizing.

    Raises:
        UserCodeError: the data factory fails or returns something that is not a Dataset.
    """
    if spec.kind == "hf":
        import os

        from zerorun.hf.data import build_hf_datasets

        return build_hf_datasets(spec, progress, local_rank=int(os.environ.get("LOCAL_RANK", 0)))
    if spec.kind == "text":
        tokens = read_corpus(spec.paths)
        n_val = int(len(tokens) * spec.val_fraction)
        train = ByteWindows(tokens[:len(tokens) - n_val], spec.seq_len)
        val = ByteWindows(tokens[len(tokens) - n_val:], spec.seq_len) if n_val > spec.seq_len else None
        return train, val
    out: Any = call_factory(spec.module, spec.factory, spec.kwargs)
    train, val = out if isinstance(out, tuple) and len(out) == 2 else (out, None)
    for what, ds in (("train", train), ("validation", val)):
        if ds is not None and not (hasattr(ds, "__getitem__") and hasattr(ds, "__len__")):
            raise UserCodeError(f"{spec.module}: {spec.factory}() returned a {what} set of type "
                                f"{type(ds).__name__}, not a map-style Dataset")
    return train, val


class _SkipSampler(torch.utils.data.Sampler):
    """``sampler``'s indices without the first ``skip``."""

    def __init__(self, sampler, skip: int) -> None:
        self.sampler, self.skip = sampler, skip

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(iter(self.sampler), self.skip, None)

    def __len__(self) -> int:
        return max(0, len(self.sampler) - self.skip)


def batch_stream(dataset, sampler, micro_batch_size: int, position) -> Iterator[Any]:
    """Endless micro-batches of ``micro_batch_size`` samples from ``dataset`` in ``sampler``'s order (a
    ``DistributedSampler``: ``set_epoch`` is called at each epoch), starting at ``position`` (a
    :class:`zerorun.checkpoint.DataPosition`), which is kept up to date as batches are yielded (Note [Exact
    resume] in checkpoint/saving.py)."""
    from torch.utils.data import DataLoader

    generator = torch.Generator()  # the loader's own: making its iterator draws no global random number
    skip = position.batch
    while True:
        sampler.set_epoch(position.epoch)
        loader = DataLoader(dataset, batch_size=micro_batch_size,
                            sampler=_SkipSampler(sampler, skip * micro_batch_size), drop_last=True, generator=generator)
        for batch in loader:
            position.batch += 1
            yield batch
        position.epoch += 1
        position.batch = skip = 0
