"""Reading a DCP checkpoint folder without running code from it and without leaving a target unwritten.

Note [Untrusted checkpoints]: a checkpoint folder is input: whoever wrote it chose every byte, the SHA-256
list in ``zerorun.json`` included. Torch's distributed checkpoint (DCP) stores non-tensor values as
``BytesStorageMetadata`` entries that its default load planner reads with ``torch.load(weights_only=False)``,
i.e. an arbitrary pickle. zerorun saves tensors only, so:

1. :func:`check_entries` refuses, as soon as ``.metadata`` is read and before any data file is opened, every
   entry that is not a tensor, every chunk outside its tensor, chunks that overlap or leave elements of a
   tensor uncovered, a chunk without a storage record, a storage record for no chunk, a data file outside
   the folder and any stream transform (zerorun writes none).
2. :class:`SafeLoadPlanner` is DCP's default load planner except that it never unpickles (``load_bytes``
   raises) and counts the elements written into each target; :meth:`SafeLoadPlanner.unwritten` names the
   first target not entirely written once ``dcp.load`` returned (a checkpoint with a key whose chunks were
   dropped would otherwise leave that target at its fresh value, silently).

Tensor data itself is read by DCP's ``FileSystemReader`` with ``torch.load(weights_only=True)``, and
``.metadata`` by a restricted unpickler (:class:`SafeReader`, which runs :func:`check_entries`). A failed save
is explained in one line by :func:`why_not_written`.
"""

from __future__ import annotations

import importlib
import io
import math
import os
import pickle
import sys
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from zerorun.errors import ZerorunError


def _boxes_overlap(a_off, a_size, b_off, b_size) -> bool:
    """Whether two n-dimensional boxes (offsets, sizes) share at least one element."""
    return all(max(ao, bo) < min(ao + asz, bo + bsz) for ao, asz, bo, bsz in zip(a_off, a_size, b_off, b_size))


def _check_chunks(fqn: str, size: tuple[int, ...], chunks: list, where: str) -> None:
    """The chunks of one tensor of shape ``size`` lie inside it, do not overlap and cover all of it."""
    total = 0
    for c in chunks:
        off, sz = tuple(c.offsets), tuple(c.sizes)
        if len(off) != len(size) or len(sz) != len(size) or any(
                o < 0 or s < 0 or o + s > n for o, s, n in zip(off, sz, size)):
            raise ZerorunError(f"{where}: key {fqn!r}: chunk at {list(off)} of shape {list(sz)} lies outside the "
                               f"tensor of shape {list(size)}: not a checkpoint zerorun wrote")
        total += math.prod(sz)
    nonempty = [c for c in chunks if math.prod(c.sizes) > 0]
    if len(size) == 1:  # zerorun's sharded tensors are 1-D: sort and compare neighbours
        spans = sorted((c.offsets[0], c.offsets[0] + c.sizes[0]) for c in nonempty)
        overlap = any(a[1] > b[0] for a, b in zip(spans, spans[1:]))
    else:  # whole tensors: one chunk each
        overlap = any(_boxes_overlap(a.offsets, a.sizes, b.offsets, b.sizes)
                      for i, a in enumerate(nonempty) for b in nonempty[i + 1:])
    if overlap or total != math.prod(size):
        raise ZerorunError(f"{where}: key {fqn!r}: its chunks {'overlap' if overlap else 'do not cover it'} "
                           f"({total} of {math.prod(size)} elements): not a checkpoint zerorun wrote")


def check_entries(metadata: Any, where: str) -> None:
    """Refuse DCP ``metadata`` (read from the file ``where``) unless it describes tensors only, each tiled
    exactly by its chunks, each chunk stored in a plain file of the folder without transforms (Note
    [Untrusted checkpoints]).

    Raises:
        ZerorunError: one line naming ``where`` and the first offending key.
    """
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    entries = getattr(metadata, "state_dict_metadata", None)
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(entries, dict) or not isinstance(storage, dict):
        raise ZerorunError(f"{where}: unreadable checkpoint metadata (no entries or storage records)")
    wanted = set()
    for fqn, md in entries.items():
        if type(md) is not TensorStorageMetadata:
            raise ZerorunError(f"{where}: key {fqn!r} holds a {type(md).__name__}, not a tensor: zerorun "
                               "checkpoints hold tensors only, and reading it would unpickle arbitrary code; "
                               "refusing the checkpoint")
        _check_chunks(str(fqn), tuple(md.size), list(md.chunks), where)
        for c in md.chunks:
            index = MetadataIndex(fqn, c.offsets)
            if math.prod(c.sizes) and index not in storage:
                raise ZerorunError(f"{where}: key {fqn!r}: no stored data for its chunk at {list(c.offsets)}")
            wanted.add(index)
    for index, info in storage.items():
        if index not in wanted:
            raise ZerorunError(f"{where}: stored data for {getattr(index, 'fqn', index)!r}, which is no "
                               "tensor chunk of the checkpoint: not a checkpoint zerorun wrote")
        rel = getattr(info, "relative_path", None)
        if not isinstance(rel, str) or os.path.basename(rel) != rel or rel.startswith("."):
            raise ZerorunError(f"{where}: key {index.fqn!r} is stored in {rel!r}, not a data file of the "
                               "checkpoint folder")
        if getattr(info, "transform_descriptors", None):
            raise ZerorunError(f"{where}: key {index.fqn!r} is stored with transforms "
                               f"{list(info.transform_descriptors)}: zerorun writes none")


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner that never unpickles and counts what it writes (Note [Untrusted
    checkpoints]). Use one instance per ``dcp.load`` call, then :meth:`unwritten`."""

    def __init__(self, pager=None) -> None:
        super().__init__(allow_partial_load=False)
        self.written: dict[str, int] = {}
        self.pager = pager  # disk offload: Note [Paged checkpoints] in zero/state_paging.py

    def resolve_tensor(self, read_item) -> torch.Tensor:
        """Where DCP copies ``read_item``'s data: the pager's buffer for paged entries, else the target."""
        page = self.pager.resolve_tensor(read_item) if self.pager is not None else None
        return super().resolve_tensor(read_item) if page is None else page

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        """Refuse: a non-tensor entry would be unpickled with ``weights_only=False``.

        Raises:
            ZerorunError: always, naming the key.
        """
        raise ZerorunError(f"key {read_item.dest_index.fqn!r} is not a tensor: refusing to unpickle it")

    def commit_tensor(self, read_item, tensor: torch.Tensor) -> None:
        """Count the elements written into the target of ``read_item``; paged ones go to the swap file."""
        fqn = read_item.dest_index.fqn
        self.written[fqn] = self.written.get(fqn, 0) + math.prod(read_item.lengths)
        if self.pager is not None:
            self.pager.commit_tensor(read_item, tensor)

    def unwritten(self) -> str | None:
        """After ``dcp.load``: the first target (key) not every element of which was written, with counts,
        or ``None`` when every target was filled. Targets are tensors or ``ShardedTensor`` s (their local
        shards count)."""
        for fqn, target in self.state_dict.items():
            if hasattr(target, "local_shards"):
                want = sum(s.tensor.numel() for s in target.local_shards())
            elif isinstance(target, torch.Tensor):
                want = target.numel()
            else:
                return f"{fqn!r} (not a tensor)"
            got = self.written.get(fqn, 0)
            if got != want:
                return f"{fqn!r} ({got} of {want} elements read)"
        return None


class _MetadataUnpickler(pickle.Unpickler):
    """Admits only the classes DCP's ``.metadata`` is made of (no arbitrary code on load).

    From DCP's own modules only the classes they define are admitted, by plain name: pickle protocol 4 looks
    up a dotted name (``os.system``) attribute by attribute, and those modules import ``os``, ``torch`` and
    ``io``, so admitting "any name of the module" admitted every function of those too.
    """

    _MODULES = {"torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.planner"}
    _NAMES = {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
              ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
              ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"),
              ("pathlib", "PureWindowsPath")}

    def find_class(self, module: str, name: str) -> Any:
        if "." not in name:
            if module in self._MODULES:
                found = getattr(sys.modules.get(module) or importlib.import_module(module), name, None)
                if isinstance(found, type) and found.__module__ == module:
                    return found
            elif (module, name) in self._NAMES or (
                    module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
                return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}")


class SafeReader(FileSystemReader):
    """DCP's file reader with a restricted unpickler for ``.metadata`` (tensors are already read with
    ``weights_only=True``) that refuses every non-tensor entry before any data is read (Note [Untrusted
    checkpoints] in ``safety.py``), and :meth:`check_files` to name a truncated file before reading it."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        path = os.path.join(str(self.path), ".metadata")
        try:
            with open(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except FileNotFoundError:
            raise ZerorunError(f"{path}: missing: not a DCP checkpoint") from None
        except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError, IndexError) as e:
            raise ZerorunError(f"{path}: unreadable checkpoint metadata ({type(e).__name__}: {e})") from None
        from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

        if not isinstance(metadata, Metadata):
            raise ZerorunError(f"{path}: unreadable checkpoint metadata (not DCP metadata)")
        check_entries(metadata, path)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan, planner):
        """DCP's ``read_data`` (one pass over each file); when it fails, the plan is read again one item at a
        time to name the file and key that fail (a data file holding a pickle instead of tensor data, a short or
        corrupt file), not only "CheckpointException ranks:...". Loading is failing by then, so reading an item
        twice costs nothing that matters; a load that succeeds pays nothing.

        Raises:
            ZerorunError: ``<file>: key '<key>': <reason>`` (DCP wraps it per rank: :func:`reason`).
        """
        try:
            done = super().read_data(plan, planner)
            done.wait()
            return done
        except ZerorunError:
            raise
        except Exception as e:  # noqa: BLE001 - torch.load's and the stream's errors alike, named below
            first = e
        from torch.distributed.checkpoint.planner import LoadPlan

        for item in plan.items:
            try:
                super().read_data(LoadPlan([item]), planner).wait()
            except ZerorunError:
                raise
            except Exception as e:  # noqa: BLE001
                file = os.path.join(str(self.path), self.storage_data[item.storage_index].relative_path)
                raise ZerorunError(f"{file}: key {item.storage_index.fqn!r}: {_first_line(e)}") from None
        raise ZerorunError(f"{self.path}: {_first_line(first)}")

    def check_files(self) -> Any:
        """Read the metadata and check that every data file exists and is long enough for every chunk.

        Returns:
            DCP's ``Metadata``.

        Raises:
            ZerorunError: naming the file and the first key whose bytes are missing, or a data file that is a
                symbolic link.
        """
        metadata = self.read_metadata()
        sizes: dict[str, int] = {}
        for index, info in sorted(metadata.storage_data.items(), key=lambda kv: kv[1].offset):
            path = os.path.join(str(self.path), info.relative_path)
            if path not in sizes and os.path.islink(path):
                raise ZerorunError(f"{path}: a symbolic link, not a data file of the checkpoint folder (holds key "
                                   f"{index.fqn!r}): refusing the checkpoint")
            if path not in sizes:
                try:
                    sizes[path] = os.path.getsize(path)
                except OSError:
                    raise ZerorunError(f"{path}: missing (holds key {index.fqn!r})") from None
            if info.offset + info.length > sizes[path]:
                raise ZerorunError(f"{path}: truncated: {sizes[path]} bytes, key {index.fqn!r} needs bytes "
                                   f"{info.offset}..{info.offset + info.length}")
        return metadata


def _failures(e: BaseException) -> list[BaseException]:
    """The exceptions inside DCP's ``CheckpointException`` (per rank, wrapped with their traceback), in rank
    order; ``[e]`` when it holds none."""
    found = [v[0] if isinstance(v, tuple) else v for _, v in sorted(getattr(e, "failures", {}).items())]
    return [f for f in found if isinstance(f, BaseException)] or [e]


def _first_line(e: BaseException) -> str:
    """``e`` in one line; torch.load's refusal of a pickle (whose first line suggests ``weights_only=False``)
    as what it refused."""
    text = str(e).strip()
    if isinstance(e, pickle.UnpicklingError) or "Weights only load failed" in text:
        detail = next((line.strip() for line in text.splitlines() if "Unsupported" in line
                       or "WeightsUnpickler error" in line), "")
        return "not tensor data: refusing to unpickle it" + (f" ({detail})" if detail else "")
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


def reason(e: BaseException) -> str:
    """Why a DCP load failed, in one line: the first rank's inner exception (a :class:`ZerorunError` as it is,
    naming file and key), not DCP's ``CheckpointException ranks:dict_keys([0])``."""
    first = _failures(e)[0]
    return str(first) if isinstance(first, ZerorunError) else _first_line(first)


def why_not_written(e: BaseException, folder: str) -> str:
    """One line saying why a save into ``folder`` failed (DCP's, or one file's: ``zerorun consolidate``): the
    first ``OSError``'s reason and file ("No space left on device", "File too large"), among the failures and what
    raised them (torch's zip writer raises "unexpected pos" from the ``OSError`` of the write; safetensors' Rust
    writer says "(os error 28)"); else the cause found on this host (a file of ``folder`` at the file-size limit,
    less than 1 MiB free on its device); else the first failure's first line."""
    import re
    import resource

    failures = _failures(e)
    for f in failures:
        for link in _raised_from(f):
            if isinstance(link, OSError) and link.strerror:
                return link.strerror + (f" ({link.filename})" if link.filename else "")
            number = re.search(r"\(os error (\d+)\)", str(link))
            if number:
                return os.strerror(int(number.group(1)))
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    try:
        sizes = [os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder)]
        free = os.statvfs(folder).f_bavail * os.statvfs(folder).f_frsize
    except OSError:
        sizes, free = [], None
    if limit != resource.RLIM_INFINITY and sizes and max(sizes) >= limit:
        return f"File too large (the file-size limit, ulimit -f, is {limit} bytes)"
    if free is not None and free < 2**20:
        return f"No space left on device ({free} bytes free)"
    first = failures[0]
    text = str(first).strip()
    return f"{type(first).__name__}: {text.splitlines()[0]}" if text else type(first).__name__


def _raised_from(e: BaseException, most: int = 8) -> list[BaseException]:
    """``e`` and the exceptions it was raised from or while handling, nearest first."""
    out = [e]
    while len(out) < most and (out[-1].__cause__ or out[-1].__context__) is not None:
        out.append(out[-1].__cause__ or out[-1].__context__)
    return out
