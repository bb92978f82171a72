"""Deferred initialization: build a model on the meta device, then give each rank exactly the values that
normal construction with the same seed would give, materializing one tensor at a time.

Note [Record and replay]: :func:`deferred_init` runs the user's factory under ``torch.device("meta")`` with a
dispatch mode that records every aten op (shapes only, no memory). :func:`replay` runs the recorded ops again,
in order, on real tensors: random fills draw from the generator in the same order and with the same sizes as
normal construction, so the values are bit-for-bit the same. To stay memory-bounded, a storage is
materialized only for the ops that matter: an op that overwrites a whole storage without reading it (a random
fill, ``zero_``, ``fill_``, ``copy_``) starts a new life of that storage, and the previous life is freed right
after its last op (its random draws still happen, on a temporary, so the generator advances as it should). At
the last op of a parameter's storage the caller's ``keep`` callback takes the part it wants (its shard) and the
full tensor is freed. Peak memory is a few parameters, not the model. Ops on real (non-meta) tensors inside the
factory run normally and are not replayed.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

_FULL_WRITES = {"uniform_", "normal_", "zero_", "fill_", "copy_", "bernoulli_", "exponential_", "geometric_",
                "log_normal_", "cauchy_", "random_", "trunc_normal_"}


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple[Any, tuple, dict, Any]] = []
        self.rng: torch.Tensor | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if any(isinstance(t, torch.Tensor) and t.is_meta for t in tree_flatten((args, kwargs, out))[0]):
            if self.rng is None:  # after any torch.manual_seed the factory itself calls first
                self.rng = torch.get_rng_state()
            self.log.append((func, args, kwargs, out))
        return out


def deferred_init(factory: Callable[..., nn.Module], *args: Any, **kwargs: Any) -> nn.Module:
    """``factory(*args, **kwargs)`` built on the meta device (no parameter memory), with the recording that
    :func:`replay` needs attached. The generator state at the first recorded op (after any
    ``torch.manual_seed`` the factory calls itself) is saved: the replay starts from it, as normal construction
    would.

    Raises:
        RuntimeError: the factory consumed random numbers on real tensors, which a replay cannot reproduce.
    """
    recorder = _Recorder()
    with torch.device("meta"), recorder:
        model = factory(*args, **kwargs)
    rng = recorder.rng if recorder.rng is not None else torch.get_rng_state()
    if not torch.equal(torch.get_rng_state(), rng):
        raise RuntimeError("the model factory drew random numbers on real (non-meta) tensors while building: "
                           "deferred initialization cannot reproduce them; build those tensors as parameters")
    if not isinstance(model, nn.Module):
        return model
    model._zerorun_deferred = (recorder.log, rng)  # type: ignore[attr-defined]
    return model


def is_deferred(model: nn.Module) -> bool:
    """True when ``model`` came from :func:`deferred_init` and has not been materialized."""
    return hasattr(model, "_zerorun_deferred")


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _is_full_write(func, args) -> bool:
    name = func.__name__.split(".")[0] if hasattr(func, "__name__") else str(func)
    if name not in _FULL_WRITES or not args or not isinstance(args[0], torch.Tensor):
        return False
    t = args[0]
    return t.is_contiguous() and t.storage_offset() == 0 and t.numel() * t.element_size() == t.untyped_storage().nbytes()


def replay(model: nn.Module, keep: Callable[[torch.Tensor, torch.Tensor], None], device: torch.device | str = "cpu",
           tensors: list[torch.Tensor] | None = None) -> int:
    """Replay ``model``'s recorded construction on ``device`` (Note [Record and replay]).

    ``keep(meta_tensor, real_tensor)`` is called once for every tensor of ``tensors`` (default: the meta
    parameters and buffers of ``model``), at the last
    op of its storage, with its real values (shape and dtype of the meta tensor); after it returns the real
    storage is freed unless ``keep`` holds a reference. Generator state is restored to the recorded one first
    and left where normal construction would leave it.

    Returns:
        The peak bytes of real storage the replay held at once (the memory bound of Note [Record and replay]).

    Raises:
        RuntimeError: ``model`` was not built by :func:`deferred_init`.
    """
    if not is_deferred(model):
        raise RuntimeError("model was not built by zerorun.zero.deferred_init")
    log, rng = model._zerorun_deferred  # type: ignore[attr-defined]
    device = torch.device(device)
    wanted: dict[int, list[torch.Tensor]] = {}
    if tensors is None:
        tensors = list(model.parameters()) + list(model.buffers())
    for t in tensors:
        wanted.setdefault(_key(t), []).append(t)

    # Lives of every storage: op indices where it is used; a full write starts a new life.
    uses: dict[int, list[int]] = {}
    for i, (func, args, kwargs, out) in enumerate(log):
        for t in tree_flatten((args, kwargs, out))[0]:
            if isinstance(t, torch.Tensor) and t.is_meta:
                k = _key(t)
                if not uses.get(k) or uses[k][-1] != i:
                    uses.setdefault(k, []).append(i)
    last_use = {k: v[-1] for k, v in uses.items()}
    ends_life: dict[int, list[int]] = {}  # op index -> storages whose current life ends after it
    for k, idx in uses.items():
        for a, b in zip(idx, idx[1:]):
            func, args, _, _ = log[b]
            if _is_full_write(func, args) and _key(args[0]) == k:
                ends_life.setdefault(a, []).append(k)

    real: dict[int, torch.UntypedStorage] = {}

    def to_real(x):
        if not (isinstance(x, torch.Tensor) and x.is_meta):
            return x
        k = _key(x)
        storage = real.get(k)
        if storage is None:  # first op of a new life (a full write): fresh, uninitialized memory
            storage = real[k] = torch.empty(x.untyped_storage().nbytes(), dtype=torch.uint8, device=device).untyped_storage()
        return torch.empty(0, dtype=x.dtype, device=device).set_(storage, x.storage_offset(), x.size(), x.stride())

    def fix_device(v):
        return device if isinstance(v, torch.device) and v.type == "meta" else v

    torch.set_rng_state(rng)
    peak = 0
    with torch.no_grad():
        for i, (func, args, kwargs, out) in enumerate(log):
            real_args = tree_map(to_real, args)
            real_kwargs = tree_map(fix_device, tree_map(to_real, kwargs))
            result = func(*real_args, **real_kwargs)
            for m, r in zip(tree_flatten(out)[0], tree_flatten(result)[0]):
                if isinstance(m, torch.Tensor) and m.is_meta and isinstance(r, torch.Tensor):
                    real.setdefault(_key(m), r.untyped_storage())
            peak = max(peak, sum(s.nbytes() for s in real.values()))
            for k in ends_life.get(i, ()):
                if last_use[k] != i:
                    real.pop(k, None)
            for k in [k for k in list(real) if last_use.get(k) == i]:
                for t in wanted.pop(k, ()):
                    keep(t, to_real(t))
                real.pop(k, None)
    for k, tensors in wanted.items():  # never touched by an op (e.g. torch.empty without init): zeros
        for t in tensors:
            keep(t, torch.zeros(t.shape, dtype=t.dtype, device=device))
    del model._zerorun_deferred  # type: ignore[attr-defined]
    return peak


def materialize(model: nn.Module, device: torch.device | str = "cpu") -> nn.Module:
    """Replay ``model`` in full on ``device``: every parameter and buffer gets its real values (the same as
    normal construction with the same seed). For stages 0-2, which hold whole parameters anyway."""
    values: dict[int, torch.Tensor] = {}

    def keep(meta: torch.Tensor, value: torch.Tensor) -> None:
        values[id(meta)] = value.clone()

    replay(model, keep, device)
    swap_meta_tensors(model, lambda meta: values[id(meta)])
    return model


def swap_meta_tensors(model: nn.Module, value_of: Callable[[torch.Tensor], torch.Tensor]) -> dict[int, torch.Tensor]:
    """Replace every meta parameter and buffer of ``model`` by ``value_of(meta)`` (a real tensor; parameters
    are wrapped in new ``nn.Parameter`` objects with the same ``requires_grad``). A tensor shared by several
    modules (tied weights) is replaced by one shared object. A meta tensor cannot take real data in place.

    Returns:
        ``{id(meta tensor): its replacement}``.
    """
    done: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for table, is_param in ((module._parameters, True), (module._buffers, False)):
            for name, t in list(table.items()):
                if t is None or not t.is_meta:
                    continue
                if id(t) not in done:
                    v = value_of(t)
                    done[id(t)] = nn.Parameter(v, requires_grad=t.requires_grad) if is_param else v
                table[name] = done[id(t)]
    return done
