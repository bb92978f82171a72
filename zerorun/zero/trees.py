"""Walks over the structures users keep tensors in: a micro-batch (a dataset's samples collated, or what
``data.collate`` returns) and a model's output.

Note [Batch structures]: torch's pytree knows tuples, lists, dicts and named tuples; a user's collate or model
also returns a dataclass, a ``collections.UserDict`` (transformers' ``BatchEncoding``, what a tokenizer and its
padding collators return), another ``Mapping``, or an object with a ``.loss``. A DataLoader passes any of them
through, and DeepSpeed, accelerate and a plain loop train on them, so zerorun finds and moves the tensors in
all of them, keeping each container's type: a named tuple was rebuilt as ``type(batch)(generator)`` (a
``TypeError`` on the rank), and a ``BatchEncoding`` or a dataclass was refused as "not a batch holding tensors"
(a review of the data path). An object with a ``.to`` method of its own is moved by it, as accelerate's
``send_to_device`` does: a ``PackedSequence`` keeps its ``batch_sizes`` on the CPU, which a walk of its fields would
move too (a review of that); but a mapping is walked, since ``BatchEncoding.to`` moves its top-level tensors only
(a review of that).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from typing import Any, Callable

import torch
import torch.nn as nn

_DEPTH = 32  # deeper structures are left as they are (a cycle through an object's attributes ends here)


def tensors_in(obj: Any, _depth: int = 0, attributes: bool = True) -> list[torch.Tensor]:
    """Every tensor inside ``obj``: a tensor, or (recursively, 32 levels deep at most) lists, tuples (named
    tuples too), mappings (``UserDict``, ``BatchEncoding``, ``transformers``' ``ModelOutput``), dataclass
    instances and plain objects' attributes (an object with a ``.loss``); without ``attributes``, only those
    of an object with a ``.to`` method of its own (what :func:`map_tensors` and its ``own`` reach). Note [Batch
    structures]."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if _depth > _DEPTH or obj is None or isinstance(obj, (str, bytes, int, float, bool, nn.Module)):
        return []
    if isinstance(obj, (dict, Mapping)):
        values = list(obj.values())
    elif isinstance(obj, (list, tuple, set, frozenset)):
        values = list(obj)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        values = [getattr(obj, f.name, None) for f in dataclasses.fields(obj)]
    elif hasattr(obj, "__dict__") and not isinstance(obj, type) and not callable(obj) and (
            attributes or callable(getattr(obj, "to", None))):
        values = list(vars(obj).values())
    else:
        return []
    return [t for v in values for t in tensors_in(v, _depth + 1, attributes)]


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], obj: Any,
                own: Callable[[Any], Any] | None = None, _depth: int = 0) -> Any:
    """``obj`` with each tensor ``t`` inside it replaced by ``fn(t)``, every container keeping its type (Note
    [Batch structures]): lists, tuples and named tuples; mappings (``dict``, ``OrderedDict``, ``defaultdict``,
    ``UserDict``: a shallow copy with each value replaced; a plain ``dict`` where the mapping cannot be copied or
    written); dataclass instances (a shallow copy, each field replaced, frozen ones too). With ``own``, an object
    with a ``.to`` method of its own that is no mapping is ``own(obj)`` instead (``PackedSequence``, whose
    ``batch_sizes`` stay on the CPU); a mapping is walked (``BatchEncoding``: its ``.to`` moves its top-level
    tensors only, in place). Anything else is ``obj`` itself. ``obj`` is not changed (but by ``own``)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if _depth > _DEPTH:
        return obj
    if own is not None and callable(getattr(obj, "to", None)) and not isinstance(obj, (type, Mapping)):
        return own(obj)  # a mapping is walked: BatchEncoding.to moves its top-level tensors only (a review)

    def walk(value: Any) -> Any:
        return map_tensors(fn, value, own, _depth + 1)

    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a named tuple: its fields as arguments
        return type(obj)(*map(walk, obj))
    if isinstance(obj, (list, tuple)):
        values = [walk(v) for v in obj]
        try:
            return type(obj)(values)
        except TypeError:  # a subclass taking other arguments
            return values if isinstance(obj, list) else tuple(values)
    if isinstance(obj, Mapping):
        try:
            out = copy.copy(obj)
            for k in obj:
                out[k] = walk(obj[k])
            return out
        except (TypeError, AttributeError, NotImplementedError):  # read-only (a mappingproxy)
            return {k: walk(v) for k, v in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out = copy.copy(obj)
        for f in dataclasses.fields(obj):
            if hasattr(obj, f.name):
                object.__setattr__(out, f.name, walk(getattr(obj, f.name)))
        return out
    return obj
