"""Deferred initialization: build a model on the meta device, then give each rank exactly the values that
normal construction with the same seed would give, materializing one tensor at a time.

Note [Record and replay]: :func:`deferred_init` runs the user's factory with tensor factories sent to the
meta device and every aten op on a meta tensor recorded (shapes only, no memory; zero/record.py, Note [What
the recording sees], also says how the record is verified and when the model is built normally instead).
:func:`replay` runs the recorded ops again, in order, on real tensors: random fills draw from the generator in
the same order and with the same sizes as normal construction, so the values are bit-for-bit the same. To
stay memory-bounded, a storage is materialized only for the ops that matter: an op that overwrites a whole
storage without reading it (a random fill, ``zero_``, ``fill_``, ``copy_``) starts a new life of that
storage, and the previous life is freed right after its last op (its random draws still happen, on a
temporary, so the generator advances as it should). At the last op of a parameter's storage the caller's
``keep`` callback takes the part it wants (its shard) and the full tensor is freed. Peak memory is a few
parameters, not the model. Tensors built from data (``torch.tensor``, ``from_numpy``) are real from the start
and are handed to ``keep`` as they are.

Note [One initialization on every rank]: each rank records its own construction. Given a process group,
:func:`replay` makes every rank replay from rank 0's generator state (a model seeded by rank gets rank 0's
initialization, as a normally built model broadcast from rank 0 does) and compares a digest of the records
(ops, shapes, dtypes, constants, values of real tensors) across ranks: construction that differs otherwise
(a constant that depends on the rank, another architecture) is an error on every rank, never a mix.
"""

from __future__ import annotations

import hashlib
import warnings
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_map

from zerorun.zero.comm import group_device
from zerorun.zero.precision import compute_dtype
from zerorun.zero.record import (Record, holds_meta_tensor, key, parameter_hooks, record, rng_states,
                                 set_rng_states)

_FULL_WRITES = {"uniform_", "normal_", "zero_", "fill_", "copy_", "bernoulli_", "exponential_", "geometric_",
                "log_normal_", "cauchy_", "random_", "trunc_normal_"}


def deferred_init(factory: Callable[..., nn.Module], *args: Any, **kwargs: Any) -> nn.Module:
    """``factory(*args, **kwargs)`` built on the meta device (no parameter memory), with the recording that
    :func:`replay` needs attached (Note [Record and replay]). The generator state at the first recorded op
    (after any ``torch.manual_seed`` the factory calls itself) is saved: the replay starts from it, as normal
    construction would.

    When the construction cannot be recorded completely (Note [What the recording sees] in record.py), the
    generator is reset and the model is built normally, with a ``UserWarning`` naming the reason
    (:func:`is_deferred` is then ``False``).

    Raises:
        Whatever ``factory`` raises when built normally.
    """
    device = torch.get_default_device()
    start = rng_states(device)
    try:
        model, rec = record(factory, args, kwargs)
    except Exception as e:  # noqa: BLE001 - any failure under recording: build it for real instead
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        set_rng_states(start, device)
        model = factory(*args, **kwargs)
        warnings.warn(f"deferred_init: {getattr(factory, '__name__', factory)} built normally (every rank holds "
                      f"the whole model while it is sharded) because its construction cannot be replayed on "
                      f"the meta device: {reason}", stacklevel=2)
        return model
    if isinstance(model, nn.Module):
        model._zerorun_deferred = rec  # type: ignore[attr-defined]
    return model


def is_deferred(model: nn.Module) -> bool:
    """True when ``model`` came from :func:`deferred_init` and has not been materialized."""
    return hasattr(model, "_zerorun_deferred")


def place_on(model: nn.Module, device: torch.device | str) -> None:
    """Keep ``model``'s materialized values (stage 3: this rank's slices) on ``device``. The replay itself
    runs on the construction device (torch's default device during :func:`deferred_init`, normally the CPU),
    so that its values are those of normal construction followed by ``.to(device)``."""
    model._zerorun_deferred.place = torch.device(device)  # type: ignore[attr-defined]


def placement(model: nn.Module) -> torch.device:
    """Where a deferred ``model``'s materialized values are kept (:func:`place_on`)."""
    return model._zerorun_deferred.place  # type: ignore[attr-defined]


def _is_full_write(func, args) -> bool:
    name = func.__name__.split(".")[0] if hasattr(func, "__name__") else str(func)
    if name not in _FULL_WRITES or not args or not isinstance(args[0], torch.Tensor):
        return False
    t = args[0]
    return t.is_contiguous() and t.storage_offset() == 0 and t.numel() * t.element_size() == t.untyped_storage().nbytes()


def _lives(log: list) -> tuple[dict[int, int], dict[int, list[int]]]:
    """The lives of every meta storage in the recorded ``log`` (Note [Record and replay]): the op index of each
    storage's last use, and per op index the storages whose current life ends after it (a full write starts a new
    life: the storage is freed before it and the write gets fresh memory)."""
    last_use: dict[int, int] = {}
    ends_life: dict[int, list[int]] = {}
    for i, (func, args, kwargs, out) in enumerate(log):
        used = {key(t) for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor) and t.is_meta}
        k = key(args[0]) if _is_full_write(func, args) else None
        if k in used and k in last_use:
            ends_life.setdefault(last_use[k], []).append(k)
        last_use.update(dict.fromkeys(used, i))
    return last_use, ends_life


def replay(model: nn.Module, keep: Callable[[torch.Tensor, torch.Tensor], None],
           tensors: list[torch.Tensor] | None = None, process_group: dist.ProcessGroup | None | bool = False) -> int:
    """Replay ``model``'s recorded construction on its construction device (Note [Record and replay]).

    ``keep(tensor, real_tensor)`` is called once for every tensor of ``tensors`` (default: the parameters and
    buffers of ``model``): for a meta tensor at the last op of its storage, with its real values (shape and
    dtype of the meta tensor), after which the real storage is freed unless ``keep`` holds a reference; for a
    tensor that is real already (built from data), first, with itself. Generator state is restored to the
    recorded one first and left where normal construction would leave it. With ``process_group`` (``None``:
    the world; ``False``, the default: no agreement) every rank replays the same construction (Note [One
    initialization on every rank]).

    Returns:
        The peak bytes of real storage the replay held at once (the memory bound of Note [Record and replay]).

    Raises:
        RuntimeError: ``model`` was not built by :func:`deferred_init`; with ``process_group``: the ranks
            built different models (same message on every rank).
    """
    if not is_deferred(model):
        raise RuntimeError("model was not built by zerorun.zero.deferred_init")
    rec: Record = model._zerorun_deferred  # type: ignore[attr-defined]
    log, rng = rec.log, rec.rng
    device = rec.device
    wanted: dict[int, list[torch.Tensor]] = {}
    if tensors is None:
        tensors = list(model.parameters()) + list(model.buffers())
    built = [t for t in tensors if not t.is_meta]
    if process_group is not False:
        rng = _agree(rec, built, process_group)
    with torch.no_grad():
        for t in built:  # made from data: real from the start (Note [What the recording sees])
            keep(t, t.detach())
    for t in tensors:
        if t.is_meta:
            wanted.setdefault(key(t), []).append(t)

    last_use, ends_life = _lives(log)
    real: dict[int, torch.UntypedStorage] = {}

    def to_real(x):
        if not (isinstance(x, torch.Tensor) and x.is_meta):  # a snapshot of a real tensor (record.py)
            return x.to(device) if isinstance(x, torch.Tensor) and x.dim() > 0 else x
        k = key(x)
        storage = real.get(k)
        if storage is None:  # first op of a new life (a full write): fresh, uninitialized memory
            storage = real[k] = torch.empty(x.untyped_storage().nbytes(), dtype=torch.uint8, device=device).untyped_storage()
        return torch.empty(0, dtype=x.dtype, device=device).set_(storage, x.storage_offset(), x.size(), x.stride())

    def fix_device(v):
        return device if isinstance(v, torch.device) and v.type == "meta" else v

    set_rng_states(rng, rec.device)
    peak = 0
    with torch.no_grad():
        for i, (func, args, kwargs, out) in enumerate(log):
            real_args = tree_map(to_real, args)
            real_kwargs = tree_map(fix_device, tree_map(to_real, kwargs))
            result = func(*real_args, **real_kwargs)
            for m, r in zip(tree_flatten(out)[0], tree_flatten(result)[0]):
                if isinstance(m, torch.Tensor) and m.is_meta and isinstance(r, torch.Tensor):
                    real.setdefault(key(m), r.untyped_storage())
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


def materialize(model: nn.Module, device: torch.device | str | None = None) -> nn.Module:
    """Replay ``model`` in full: every parameter and buffer gets its real values (the same as normal
    construction with the same seed), on ``device`` (default: :func:`placement`). For stages 0-2, which hold
    whole parameters anyway."""
    device = torch.device(device) if device is not None else placement(model)
    values: dict[int, torch.Tensor] = {}

    def keep(t: torch.Tensor, value: torch.Tensor) -> None:
        values[id(t)] = value.to(device, copy=True)

    replay(model, keep)
    swap_meta_tensors(model, lambda t: values[id(t)], real_too=True)
    return model


def _digest(rec: Record, built: list[torch.Tensor]) -> int:
    """A 63-bit digest of a record: ops, shapes, dtypes, constants and the values of real tensors (Note [One
    initialization on every rank])."""
    h = hashlib.blake2b(digest_size=8)

    def feed(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            h.update(f"T{tuple(x.shape)}{x.dtype}{x.is_meta}".encode())
            if not x.is_meta:
                h.update(x.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(x, torch.Generator):
            h.update(b"G")
        else:
            h.update(repr(x).encode())

    for func, args, kwargs, out in rec.log:
        h.update(str(func).encode())
        for x in tree_flatten((args, kwargs, out))[0]:
            feed(x)
    for t in built:
        feed(t)
    return int.from_bytes(h.digest(), "little") >> 1


def _agree(rec: Record, built: list[torch.Tensor], group: dist.ProcessGroup | None) -> dict[str, torch.Tensor]:
    """Rank 0's generator states, after checking that every rank of ``group`` recorded the same construction
    (Note [One initialization on every rank]). Two collectives, once, at construction.

    Raises:
        RuntimeError: the records differ; the same message on every rank.
    """
    comm = group_device(group)
    mine = torch.tensor([_digest(rec, built)], dtype=torch.int64, device=comm)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    digests = [int(d.item()) for d in every]
    if len(set(digests)) > 1:
        differ = [r for r, d in enumerate(digests) if d != digests[0]]
        raise RuntimeError(f"deferred_init: rank(s) {differ} built a different model than rank 0 (other ops, "
                           f"shapes or constants at construction, e.g. a value that depends on the rank): build "
                           f"the same model on every rank")
    src = dist.get_global_rank(group, 0) if group is not None else 0
    states = {}
    for name, state in rec.rng.items():
        t = state.to(comm)
        dist.broadcast(t, src=src, group=group)
        states[name] = t.cpu()
    return states


def swap_meta_tensors(model: nn.Module, value_of: Callable[[torch.Tensor], torch.Tensor],
                      real_too: bool = False) -> dict[int, torch.Tensor]:
    """Replace every meta parameter and buffer of ``model`` (with ``real_too``: every one) by
    ``value_of(tensor)`` (a real tensor; parameters are wrapped in new ``nn.Parameter`` objects with the same
    ``requires_grad``). A tensor shared by several modules (tied weights) is replaced by one shared object. A
    meta tensor cannot take real data in place.

    Returns:
        ``{id(old tensor): its replacement}``.
    """
    done: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for table, is_param in ((module._parameters, True), (module._buffers, False)):
            for name, t in list(table.items()):
                if t is None or not (t.is_meta or real_too):
                    continue
                if id(t) not in done:
                    v = value_of(t)
                    done[id(t)] = nn.Parameter(v, requires_grad=t.requires_grad) if is_param else v
                table[name] = done[id(t)]
    return done


def carry_hooks(meta: torch.Tensor, new: torch.Tensor, name: str) -> None:
    """Register on ``new`` the gradient hooks (``register_hook``, ``register_post_accumulate_grad_hook``) that
    construction registered on its meta original ``meta`` (deferred init replaces every parameter object).

    Raises:
        ValueError: a hook holds a tensor built on the meta device (it could not run on real gradients).
    """
    for hook, register in parameter_hooks(meta):
        if holds_meta_tensor(hook):
            raise ValueError(
                f"parameter {name!r} has a gradient hook, registered while the model was built on the meta "
                "device, that holds a tensor made there: it cannot run on real gradients. Build the model "
                "with zerorun.zero.deferred_init (it builds such a model normally) or register the hook after "
                "zerorun.initialize")
        getattr(new, register)(hook)


def swap_meta_params(model: nn.Module, param_groups: list[dict] | None, dtype: torch.dtype):
    """Stage 3's start from a deferred model: replace its meta parameters by real ones of the same shape whose
    storage is empty (freed) and its buffers by real zeros (the replay fills them); floating-point tensors
    take ``dtype`` (Note [Mixed precision]: the replayed values are cast as they are kept; float64 stays:
    Note [Wide parameters] in precision.py). Gradient hooks the
    constructor registered move to the new parameters (:func:`carry_hooks`).

    Returns:
        ``(new_of, metas, param_groups)``: ``{id(meta tensor): its replacement}``, the meta parameters and
        buffers in model order (what :func:`replay_slices` replays), and ``param_groups`` (or ``None``) with
        its parameters replaced.

    Raises:
        ValueError: from :func:`carry_hooks`.
    """
    metas = list(model.parameters()) + list(model.buffers())
    device = placement(model)

    def value_of(meta: torch.Tensor) -> torch.Tensor:
        t = torch.zeros(meta.shape, dtype=compute_dtype(meta.dtype, dtype), device=device)
        if isinstance(meta, nn.Parameter):
            t.untyped_storage().resize_(0)
        return t

    # tensors built from data are real already (zero/record.py): they are swapped and replayed too
    new_of = swap_meta_tensors(model, value_of, real_too=True)
    names = {id(t): n for n, t in model.named_parameters()}
    for meta in metas:
        new = new_of.get(id(meta))
        if isinstance(new, nn.Parameter):
            carry_hooks(meta, new, names.get(id(new), "?"))
    if param_groups is not None:
        param_groups = [dict(g, params=[new_of.get(id(p), p) for p in g["params"]]) for g in param_groups]
    return new_of, metas, param_groups


def replay_slices(model: nn.Module, buffers: list, new_of: dict[int, torch.Tensor], metas: list[torch.Tensor],
                  group: dist.ProcessGroup | None) -> None:
    """Replay a deferred model's construction (:func:`replay`, Note [Record and replay]) keeping, of each
    parameter in one of ``buffers`` (stage 3's flat buffers, ``shard_data`` allocated), only this rank's slice
    (``FlatBuffer.keep_slice``); module buffers are kept whole. Collective over ``group`` (the agreement)."""
    where = {id(p): buf for buf in buffers for p in buf.params}

    def keep(meta: torch.Tensor, value: torch.Tensor) -> None:
        target = new_of[id(meta)]
        buf = where.get(id(target))
        with torch.no_grad():
            if buf is not None:
                buf.keep_slice(target, value)
            else:  # a module buffer (e.g. BatchNorm's running stats): kept whole
                target.copy_(value)

    replay(model, keep, tensors=metas, process_group=group)
