"""The runtime's collectives and scratch buffers: gloo's reduce-scatter as all-to-all + local sum equals
torch's own, and the gradient buffers of stages 2-3 are reused within a step and bounded."""

import pytest
import torch

import comm_cases as cases
from zerorun.zero.comm import BufferPool, Comm


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("in_place", [True, False])
def test_reduce_scatter_via_all_to_all_matches_torch(ranks, world_size, dtype, in_place):
    for r in ranks(world_size).run(cases.reduce_scatter_matches_native, dtype=dtype, in_place=in_place):
        # 2 ranks: one addition either way (exact); 3: another summation order (fp32 ulps; bf16 sums in fp32)
        tol = 0.0 if world_size == 2 and dtype == "float32" else (1e-6 if dtype == "float32" else 1e-2)
        assert r["max_abs"] <= tol * r["scale"], r
        assert r["bytes_sent"] == r["expected_bytes"]
        # 2 ranks: only the other rank's chunk is received (half the input; before: all of it)
        assert r["recv_numel"] == (1 if world_size == 2 else world_size) * r["chunk"], r


@pytest.mark.parametrize("world_size", [2, 4])
def test_coalesced_reduce_scatter_equals_each_alone(ranks, world_size):
    for r in ranks(world_size).run(cases.reduce_scatter_coalesced_matches_each, world_size_check=world_size):
        assert r["equal"], r  # the same additions in the same order: the same bits
        assert r["bytes"] == r["bytes_each"] > 0, r
        assert r["taken"] == 0 and r["untouched"], r


@pytest.mark.parametrize("stage,accum", [(2, 1), (2, 3), (3, 3)])
def test_gradient_buffers_are_bounded_and_reused(ranks, stage, accum):
    steps = 2
    for r in ranks(2).run(cases.gradient_buffer_pool, stage=stage, accum=accum, steps=steps):
        assert r["buckets"] == 8
        assert r["taken"] == 0
        # Note [Waiting in hooks]: every stage waits for the oldest reduction (Note [Program order]: waiting
        # issues no collective), so the bound holds at stage 3 too, however far communication falls behind
        assert r["max_taken"] <= r["cap"], r  # never more full bucket gradients than MAX_INFLIGHT + 1
        # allocated in the first micro-step of each step only (the pool is dropped when the optimizer step
        # begins), not once per bucket and micro-step (8 x accum x steps)
        assert r["allocated"] <= r["cap"] * steps, r
        # gloo's reduce-scatter receive buffers: as many as are in flight, reused the same way
        assert r["recv_allocated"] <= min(r["cap"], Comm.KEEP_BUFFERS) * steps, r
        assert r["max_in_flight"] <= r["cap"], r


def test_gather_handles_outlive_their_comm_and_the_interpreter(ranks):
    """Note [Last reference on the issuing thread]: a gloo worker must never drop the last reference to a work
    whose tensors were made in Python once the interpreter shuts down (it aborted the process at exit)."""
    for r in ranks(2).run(cases.handles_outlive_their_comm):
        assert r == {"gathered_held": True, "reduced_held": False, "kept": True, "dropped_freed": True}, r


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("clip", [0.0, 1.0])
def test_a_steps_last_collectives_are_held_at_its_end(ranks, stage, clip):
    """Note [Last reference on the issuing thread]: when a script ends right after ``engine.step()``, the works
    of the step's last collectives (gradient all-reduces, the norm's all-reduce, the agreements, parameter
    all-gathers) are still held by the engine's Comm, so no gloo worker drops their last reference during the
    interpreter's shutdown (it aborted 4 of 20 such exits at stage 0 before)."""
    for r in ranks(2).run(cases.last_collectives_held, stage=stage, clip=clip):
        assert r["last"] and r["unheld"] == [], r


@pytest.mark.slow
def test_scripts_that_end_right_after_a_step_exit_cleanly():
    """End to end: two-rank scripts that end right after ``engine.step()`` at stage 0 (the stage whose gradient
    all-reduces were unheld), without ``destroy_process_group``, exit 0 every time; before, 4 of 20 such pairs
    aborted (``terminate called without an active exception``; a race, so this run of 6 can miss it)."""
    import os
    import subprocess
    import sys

    from distributed import _free_port

    script = os.path.join(os.path.dirname(__file__), "exit_after_step.py")
    for _ in range(6):
        port = str(_free_port())
        ranks = [subprocess.Popen([sys.executable, script, str(r), port, "0"], stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True) for r in range(2)]
        for p in ranks:
            out = p.communicate(timeout=120)[0]
            assert p.returncode == 0 and "terminate called" not in out, (p.returncode, out[-2000:])


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("message_bytes", [0, 50_000])
def test_unit_all_gather_is_one_packed_gather_on_gloo(ranks, world_size, message_bytes):
    """Note [One all-gather per unit]: under gloo a unit's buffers (any dtypes, one empty) are gathered as one
    packed all-gather, padded to ``message_bytes`` (Note [Peer units]), the same bits as torch's all_gather of
    each, never through torch's coalesced all-gather (it corrupted the heap under stage 3's concurrency)."""
    for r in ranks(world_size).run(cases.all_gather_coalesced_matches_torch, message_bytes=message_bytes):
        assert r["wrong"] == 0, r
        assert r["coalescing_calls"] == 0, r
        assert r["bytes_sent"] == r["expected_bytes"], r
        assert r["taken"] == 0, r


def test_a_padded_gather_with_nothing_of_this_rank_still_sends_its_zeros(ranks):
    """Note [Peer units]: a rank whose members of a padded gather are all empty (or that gives none) still takes
    part with a message of zeros; a ``message_bytes`` below the inputs' bytes is a ValueError, not a larger
    message than the other ranks send."""
    for r in ranks(3).run(cases.packed_gather_edges):
        assert r["right"], r
        assert "message_bytes=16 is below the inputs' 32 bytes" in r["refused"], r
        assert r["bytes_sent"] == r["expected_bytes"], r


@pytest.mark.parametrize("stage", [2, 3])
def test_small_buckets_in_flight_are_bounded_too(ranks, stage):
    """Buckets below 1 MiB bypass the pool (heap memory, no page faults to save), but their count in flight is
    still bounded: with 8 tiny buckets, stage 2 must not hold every bucket's full gradient at once."""
    for r in ranks(2).run(cases.gradient_buffer_pool, stage=stage, accum=2, width=64):
        assert r["buckets"] == 8 and r["launches"] == 8 * 2 * 2
        assert r["max_in_flight"] <= r["cap"], r
        assert r["allocated"] == 0 and r["max_taken"] == 0  # never pooled


def test_buffer_pool_reuses_keeps_and_drops():
    pool = BufferPool(keep=2)
    big = 1 << 20  # elements: 4 MiB of fp32
    a = pool.take(big, torch.float32, torch.device("cpu"))
    ptr = a.data_ptr()
    pool.give_back(a)
    b = pool.take(big - 10, torch.float32, torch.device("cpu"))  # a smaller request is served by the kept one
    assert b.data_ptr() == ptr and b.numel() == big - 10 and pool.allocated == 1
    assert not pool.fits(2 * big, torch.float32, torch.device("cpu"))  # none free that large
    c = pool.take(2 * big, torch.float32, torch.device("cpu"))
    d = pool.take(big, torch.bfloat16, torch.device("cpu"))  # another dtype is never served by fp32 memory
    assert pool.allocated == 3 and pool.taken == 3 and pool.max_taken == 3
    for t in (b, c, d):
        pool.give_back(t)
    assert pool.taken == 0 and pool.free == 2  # keep=2: the smallest (the bf16 one, 2 MiB) was dropped
    assert pool.fits(2 * big, torch.float32, torch.device("cpu"))
    assert not pool.fits(big, torch.bfloat16, torch.device("cpu"))
    small = pool.take(100, torch.float32, torch.device("cpu"))  # below SMALL_BYTES: heap, not counted or kept
    pool.give_back(small)
    assert pool.taken == 0 and pool.free == 2
    pool.clear()
    assert pool.free == 0


def test_streams_and_wait_timer_on_cpu():
    """Note [Streams]: on the CPU the side streams are None, ``issue`` runs its block as it is, and the wait is
    timed with perf_counter (the same calls a GPU makes with CUDA streams and events)."""
    import time

    from zerorun.zero.streams import DeviceStreams, WaitTimer

    streams = DeviceStreams(torch.device("cpu"))
    assert streams.all_gather is None and streams.reduce_scatter is None
    ran = []
    with streams.issue(streams.all_gather):
        ran.append(1)
    assert ran == [1]
    timer = WaitTimer(torch.device("cpu"))
    with timer.timing():
        time.sleep(0.01)
    assert 0.01 <= timer.seconds < 1.0


@pytest.mark.slow
def test_destroy_process_group_joins_gloos_workers_after_an_engine():
    """Note [Last reference on the issuing thread]: building the first optimizer imports
    ``torch.distributed.nn.functional``, whose default arguments then held the default group, so
    ``destroy_process_group()`` left both gloo workers running into the interpreter's shutdown (the race that
    aborts exits). zerorun imports it first: the script ends with no gloo worker thread."""
    import os
    import subprocess
    import sys

    from distributed import _free_port

    script = os.path.join(os.path.dirname(__file__), "destroy_after_engine.py")
    out = subprocess.run([sys.executable, script, str(_free_port()), "2"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    threads = out.stdout.strip().splitlines()[-1].split(",")
    assert "pt_gloo_runloop" not in threads and "gloo_tcp_loop" not in threads, threads
