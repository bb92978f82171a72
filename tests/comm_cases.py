"""Rank-side cases for tests/test_comm.py (run by tests/distributed.py's RankPool)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from zerorun.zero import ZeroConfig, initialize
from zerorun.zero.comm import Comm


def reduce_scatter_matches_native(dtype: str, in_place: bool, numel_per_rank: int = 3001) -> dict:
    """Comm.reduce_scatter on gloo (all-to-all + local sum, Note [Reduce-scatter on gloo]) against torch's own
    reduce_scatter_tensor on the same inputs; bytes counted as the ring's (N-1)/N of the input; the elements of
    the receive buffer it took."""
    n, r = dist.get_world_size(), dist.get_rank()
    dt = getattr(torch, dtype)
    x = torch.randn(n * numel_per_rank, generator=torch.Generator().manual_seed(r)).to(dt)
    expected = torch.empty(numel_per_rank, dtype=dt)
    dist.reduce_scatter_tensor(expected, x.clone())
    comm = Comm()
    assert comm.reduce_scatter_via_all_to_all
    inp = x.clone()
    out = inp[r * numel_per_rank:(r + 1) * numel_per_rank] if in_place else torch.empty(numel_per_rank, dtype=dt)
    work = comm.reduce_scatter(out, inp)
    recv = work.recv.numel()
    comm.wait([work])
    return {"max_abs": (out.float() - expected.float()).abs().max().item(), "recv_numel": recv,
            "chunk": numel_per_rank,
            "scale": expected.float().abs().max().item(),
            "bytes_sent": comm.bytes_sent, "expected_bytes": (n - 1) * numel_per_rank * dt.itemsize}


def all_gather_coalesced_matches_torch(message_bytes: int) -> dict:
    """Comm.all_gather_coalesced on gloo (one packed all-gather, Note [One all-gather per unit]) against torch's
    all_gather of each pair: float32, float64, bfloat16 and int64 pairs of odd sizes (one empty), two gathers
    in flight at once beside a reduce-scatter. Also how often torch's coalescing manager ran (gloo's coalesced
    all-gather corrupts the heap: it must not), the bytes counted and the pool's tensors still out."""
    n, r = dist.get_world_size(), dist.get_rank()
    calls = []
    manager = dist.distributed_c10d._coalescing_manager

    def spy(*args, **kwargs):
        calls.append(1)
        return manager(*args, **kwargs)

    g = torch.Generator().manual_seed(r)
    layouts = [(torch.float32, 3001), (torch.float64, 17), (torch.bfloat16, 5), (torch.int64, 0), (torch.int64, 9)]
    comm = Comm()
    gathers = []
    dist.distributed_c10d._coalescing_manager = spy
    try:
        works = []
        for _ in range(2):
            inputs = [(torch.randn(k, generator=g) * 100).to(dt) for dt, k in layouts]
            outputs = [torch.full((n * k,), -1).to(dt) for dt, k in layouts]
            works.append(comm.all_gather_coalesced(outputs, inputs, message_bytes))
            gathers.append((inputs, outputs))
        grads = torch.randn(n * 4096, generator=g)
        works.append(comm.reduce_scatter(torch.empty(4096), grads))
        comm.wait(works)
    finally:
        dist.distributed_c10d._coalescing_manager = manager
    wrong = 0
    for inputs, outputs in gathers:
        for i, o in zip(inputs, outputs):
            expected = [torch.empty_like(i) for _ in range(n)]
            dist.all_gather(expected, i)
            wrong += int(not torch.equal(o, torch.cat(expected)))
    payload = sum(dt.itemsize * k for dt, k in layouts)
    return {"wrong": wrong, "coalescing_calls": len(calls), "bytes_sent": comm.bytes_sent,
            "expected_bytes": 2 * (n - 1) * max(payload, message_bytes) + (n - 1) * 4096 * 4,
            "taken": comm.recv_pool.taken}


def packed_gather_edges() -> dict:
    """Comm.all_gather_coalesced with ``message_bytes`` where this rank's pairs are all empty (rank 0: a peer unit
    whose members hold nothing here) or there are none: it still sends its zeros, in the same program order;
    and a ``message_bytes`` below the inputs' bytes is refused before anything is issued."""
    n, r = dist.get_world_size(), dist.get_rank()
    comm = Comm()
    mine = torch.arange(8, dtype=torch.float32) + 100 * r
    if r == 0:
        outputs = inputs = [torch.empty(0), torch.empty(0, dtype=torch.int64)]
    else:
        outputs, inputs = [torch.full((n * 8,), -1.0)], [mine]
    comm.wait([comm.all_gather_coalesced(outputs, inputs, message_bytes=64)])
    comm.wait([comm.all_gather_coalesced([], [], message_bytes=16)])
    try:
        comm.all_gather_coalesced([torch.empty(n * 8)], [mine], message_bytes=16)
        refused = ""
    except ValueError as e:
        refused = str(e)
    rows = [torch.zeros(8) if q == 0 else torch.arange(8, dtype=torch.float32) + 100 * q for q in range(n)]
    right = r == 0 or torch.equal(outputs[0], torch.cat(rows))
    return {"right": right, "refused": refused, "bytes_sent": comm.bytes_sent, "expected_bytes": (n - 1) * (64 + 16)}


def handles_outlive_their_comm() -> dict:
    """Note [Last reference on the issuing thread]: a Comm's last all-gather handle is held and the at-exit hook
    gives the held handles a reference that is never dropped; a reduce-scatter's handle is not held (its bucket
    would stay alive); a dropped Comm is freed (its handles pinned nothing)."""
    import gc
    import sys

    from zerorun.zero import held as held_module

    n = dist.get_world_size()
    gc.collect()  # earlier cases' engines retire now, not beside this one
    comm = Comm()
    gathered = comm.all_gather(torch.empty(4 * n), torch.ones(4))
    reduced = comm.reduce_scatter(torch.empty(4), torch.ones(4 * n))
    comm.wait([gathered, reduced])
    held = [w is gathered for w in comm.held], [w is reduced.work for w in comm.held]
    refs = sys.getrefcount(comm.held._works)
    held_module._keep_held_handles()
    kept = sys.getrefcount(comm.held._works) > refs
    import weakref
    gone = weakref.ref(Comm())
    gc.collect()
    return {"gathered_held": any(held[0]), "reduced_held": any(held[1]), "kept": kept, "dropped_freed": gone() is None}


def last_collectives_held(stage: int, clip: float) -> dict:
    """Note [Last reference on the issuing thread]: the collectives an engine issued up to the end of its last
    step, as a script that exits right after ``engine.step()`` leaves them. Every torch collective the engine
    calls is recorded (its work, or None where the call was synchronous and torch dropped the work itself);
    returned: which of the last ``Comm.HELD`` calls that are not a gradient reduce-scatter are not held by the
    Comm (a gloo worker could drop their last reference while the interpreter shuts down)."""
    from zerorun.zero import comm as comm_module

    calls = []  # (name, work or None)
    names = ("all_reduce", "broadcast", "all_to_all_single", "all_gather_into_tensor", "reduce_scatter_tensor")
    saved = {n: getattr(dist, n) for n in names} | {"_all_gather": comm_module._all_gather}

    def spy(name, fn):
        def call(*args, **kwargs):
            work = fn(*args, **kwargs)
            calls.append((name, work if kwargs.get("async_op") else None))
            return work
        return call

    for n in names:
        setattr(dist, n, spy(n, saved[n]))
    comm_module._all_gather = spy("all_gather", saved["_all_gather"])
    try:
        torch.manual_seed(0)
        engine = initialize(_Stack(16, 4), optimizer="SGD", optimizer_kwargs={"lr": 0.1},
                            config=ZeroConfig(stage=stage, grad_clip=clip,
                                              units=("Linear",) if stage == 3 else ()))
        g = torch.Generator().manual_seed(dist.get_rank())
        for _ in range(3):
            engine.backward(engine(torch.randn(4, 16, generator=g)))
            engine.step()
    finally:
        for n in names:
            setattr(dist, n, saved[n])
        comm_module._all_gather = saved["_all_gather"]
    held = {id(w) for w in engine.comm.held}
    last = [(n, w) for n, w in calls if n not in ("all_to_all_single", "reduce_scatter_tensor")][-Comm.HELD:]
    return {"unheld": [n for n, w in last if w is None or id(w) not in held], "last": [n for n, _ in last]}


class _Stack(nn.Module):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width, bias=False) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.square().mean()


def gradient_buffer_pool(stage: int, accum: int, steps: int = 2, width: int = 512) -> dict:
    """Stage 2-3 engine over 8 buckets of one ``width`` x ``width`` fp32 weight each (512: 1 MiB, pooled;
    64: 16 KiB, below the pool's SMALL_BYTES): how many full-gradient buffers its pool ever held at once and
    allocated (Note [Gradient buffer pool]), how many receive buffers the gloo reduce-scatter allocated, and
    the most reduce-scatters in flight at once (Note [Waiting in hooks]: every stage waits for the oldest)."""
    torch.manual_seed(0)
    model = _Stack(width, 8)
    engine = initialize(model, optimizer="SGD", optimizer_kwargs={"lr": 0.1},
                        config=ZeroConfig(stage=stage, bucket_mb=width * width * 4 / 2**20, grad_accum_steps=accum,
                                          units=("Linear",) if stage == 3 else ()))
    in_flight = []
    reducer = engine.reducer
    launch = reducer._launch

    def spy(buf):
        launch(buf)
        in_flight.append(len(reducer._pending))

    reducer._launch = spy
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(steps):
        for _ in range(accum):
            engine.backward(engine(torch.randn(16, width, generator=g)))
        engine.step()
    pool = reducer.pool
    return {"buckets": len(engine.buffers), "cap": engine.MAX_INFLIGHT + 1, "max_taken": pool.max_taken,
            "allocated": pool.allocated, "recv_allocated": engine.comm.recv_pool.allocated, "taken": pool.taken,
            "max_in_flight": max(in_flight), "launches": len(in_flight)}


def reduce_scatter_coalesced_matches_each(world_size_check: int) -> dict:
    """Comm.reduce_scatter_coalesced of three pairs (float32, odd sizes, one in place, one of chunk 1) against
    Comm.reduce_scatter of each alone (Note [One reduce-scatter per launch]): bit for bit, the same bytes counted,
    one collective's handle, and the receive buffer given back."""
    n, r = dist.get_world_size(), dist.get_rank()
    assert n == world_size_check
    gen = torch.Generator().manual_seed(10 + r)
    ks = [7, 1, 1025]
    inputs = [torch.randn(n * k, generator=gen) for k in ks]
    alone, each = Comm(), []
    for inp, k in zip(inputs, ks):
        out = torch.empty(k)
        alone.wait([alone.reduce_scatter(out, inp.clone())])
        each.append(out)
    comm = Comm()
    copies = [inp.clone() for inp in inputs]
    outs = [copies[0][r * ks[0]:(r + 1) * ks[0]], torch.empty(ks[1]), torch.empty(ks[2])]
    work = comm.reduce_scatter_coalesced(outs, copies)
    comm.wait([work, work])  # a second wait is a no-op (the reducer waits once per bucket of the run)
    return {"equal": all(torch.equal(a, b) for a, b in zip(outs, each)), "bytes": comm.bytes_sent,
            "bytes_each": alone.bytes_sent, "taken": comm.recv_pool.taken,
            "untouched": torch.equal(copies[1], inputs[1]) and torch.equal(copies[2], inputs[2])}
