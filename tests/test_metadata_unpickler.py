"""A checkpoint's ``.metadata`` is a pickle written by whoever wrote the folder: zerorun's reader admits only
the classes DCP's metadata is made of, by plain name. Pickle protocol 4 resolves a dotted name attribute by
attribute, so a name such as ``os.system`` looked up through DCP's own modules (which import ``os``,
``torch``, ``io``) must be refused as well, before anything runs."""

from __future__ import annotations

import io
import os
import pickle

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties,
                                                   TensorStorageMetadata)

from zerorun.checkpoint.safety import SafeReader
from zerorun.errors import ZerorunError


def _metadata() -> Metadata:
    size = torch.Size([2, 3])
    entry = TensorStorageMetadata(TensorProperties(dtype=torch.float32), size,
                                  [ChunkStorageMetadata(torch.Size([0, 0]), size)])
    stored = {MetadataIndex("model/w", torch.Size([0, 0])): _StorageInfo("__0_0.distcp", 0, 24)}
    return Metadata(state_dict_metadata={"model/w": entry}, planner_data={}, storage_data=stored)


class _Call:
    """Unpickles as ``function(*args)``; the pickler below names ``function`` by ``module`` + dotted ``name``."""

    def __init__(self, function, args) -> None:
        self.function, self.args = function, args

    def __reduce__(self):
        return (self.function, self.args)


def _crafted(function, module: str, name: str, args: tuple) -> bytes:
    """DCP metadata whose planner data holds a call of ``function``, written as ``module`` + ``name``."""

    class Pickler(pickle._Pickler):  # the pure-Python pickler lets the test choose how a global is named
        def save_global(self, obj, name_=None):
            if obj is function:
                self.save(module)
                self.save(name)
                self.write(pickle.STACK_GLOBAL)
                self.memoize(obj)
                return
            super().save_global(obj, name_)

    metadata = _metadata()
    metadata.planner_data = {"payload": _Call(function, args)}
    buf = io.BytesIO()
    Pickler(buf, protocol=4).dump(metadata)
    return buf.getvalue()


def _read(folder) -> Metadata:
    return SafeReader(str(folder)).read_metadata()


def test_plain_metadata_is_read(tmp_path):
    (tmp_path / ".metadata").write_bytes(pickle.dumps(_metadata()))
    assert list(_read(tmp_path).state_dict_metadata) == ["model/w"]


@pytest.mark.parametrize("module,name", [
    ("torch.distributed.checkpoint.metadata", "os.system"),
    ("torch.distributed.checkpoint.planner", "os.system"),
    ("torch.distributed.checkpoint.filesystem", "os.system"),
    ("torch", "os.system"),
    ("pathlib", "os.system"),
    ("collections", "os.system"),
])
def test_dotted_names_through_admitted_modules_never_run(tmp_path, module, name):
    pwned = tmp_path / "pwned"
    (tmp_path / ".metadata").write_bytes(_crafted(os.system, module, name, (f"touch {pwned}",)))
    with pytest.raises(ZerorunError, match=r"\.metadata: unreadable checkpoint metadata .*refusing to load"):
        _read(tmp_path)
    assert not pwned.exists()


@pytest.mark.parametrize("function,module,name,args", [
    (torch.load, "torch.distributed.checkpoint.planner", "torch.load", ("x",)),  # a function, not a class
    (open, "torch.distributed.checkpoint.metadata", "io.open", ("x", "w")),
    (os.remove, "torch.distributed.checkpoint.metadata", "os", ()),  # a module object, not a class
    (print, "torch.distributed.checkpoint.metadata", "dataclass", ()),  # imported there, defined elsewhere
])
def test_only_classes_defined_by_dcp_are_admitted(tmp_path, function, module, name, args):
    (tmp_path / ".metadata").write_bytes(_crafted(function, module, name, args))
    with pytest.raises(ZerorunError, match="unreadable checkpoint metadata .*refusing to load"):
        _read(tmp_path)
    assert not (tmp_path / "x").exists()
