"""zerorun estimate: the ZeRO paper's numbers, the engine's own reports, activations, sizes and hosts' memory
(the command line: tests/test_estimate_cli.py)."""

import math
import os
import re

import pytest
import torch
import torch.nn as nn

import estimate_cases as cases
from zerorun import estimate as est
from zerorun.errors import ZerorunError

FP32, BF16 = est.PRECISIONS["fp32"], est.PRECISIONS["bf16"]
ADAM = est.optimizer_model("adam")


def test_zero_paper_table_1():
    """ZeRO paper §5 / table 1: Ψ = 7.5B, N = 64, mixed precision Adam (K = 12): 120, 31.4, 16.6, 1.9 GB."""
    layout = est.layout_of_count(7_500_000_000)
    got = [est.model_states(layout, s, 64, BF16, ADAM).total for s in range(4)]
    psi = 7.5e9
    assert got == [16 * psi, 4 * psi + 12 * psi / 64, 2 * psi + 14 * psi / 64, 16 * psi / 64]
    # the paper rounds half up to 0.1 GB
    assert [math.floor(b / 1e8 + 0.5) / 10 for b in got] == [120.0, 31.4, 16.6, 1.9]


@pytest.mark.parametrize("stage,formula", [
    (0, lambda p, n: 16 * p), (1, lambda p, n: 8 * p + 8 * p / n), (2, lambda p, n: 4 * p + 12 * p / n),
    (3, lambda p, n: 16 * p / n)])
def test_fp32_adam_formulas_of_the_design(stage, formula):
    layout = est.layout_of_count(1_000_000 * 24)
    for n in (1, 2, 3, 8):
        assert est.model_states(layout, stage, n, FP32, ADAM).total == formula(24_000_000, n)


def test_padding_rounds_each_buffer_up_to_the_world_size():
    layout = est.Layout(total=10, trainable=10, frozen=0, buffers=(7, 3), frozen_params=(), units=(), exact=True)
    s = est.model_states(layout, 2, 4, FP32, est.optimizer_model("none"))
    assert s.params == (8 + 4) * 4 and s.grads == (2 + 1) * 4


def test_communication_is_2psi_and_3psi_elements():
    """ZeRO paper §7: 2Ψ elements per rank per step at stages 0-2, 3Ψ at stage 3, times the ring's (N-1)/N."""
    psi, n = 64_000_000, 8
    layout = est.layout_of_count(psi)
    for stage, k in ((0, 2), (1, 2), (2, 2), (3, 3)):
        norm = 0 if stage == 0 else 2 * 7 / 8 * 8  # the fp64 grad-norm all-reduce
        assert est.comm_bytes(layout, stage, n, BF16) == round(k * psi * 2 * (n - 1) / n + norm)
    assert est.comm_bytes(layout, 3, 1, BF16) == 0


def engine_layout(config, stage, precision="fp32"):
    model, model_kwargs, units, _, opt_kwargs, bucket_mb, _, persistence, keep = config
    with torch.device("meta"):
        m = cases.build(model, model_kwargs)
    return est.layout_of(m, bucket_mb=bucket_mb, units=units if stage == 3 else (), precision=precision,
                         persistence_threshold=persistence, **({} if keep is None else {"keep_root_bytes": keep}))


def assert_engine_reports(pool, stage, world_size, precision="fp32", reduce_dtype=None, offload="none",
                          offload_path=None, offload_params=False):
    reports = pool.run(cases.engine_reports, stage=stage, precision=precision, reduce_dtype=reduce_dtype,
                       offload=offload, offload_path=offload_path, offload_params="disk" if offload_params else "none")
    p = est.precision_of(precision, reduce_dtype)
    for i, config in enumerate(cases.CONFIGS):
        _, _, _, opt, opt_kwargs, _, accum, _, _ = config
        layout = engine_layout(config, stage, precision)
        # the ranks are CPU processes: the engine's "device" is the host (cpu offload keeps its bytes there)
        want = est.model_states(layout, stage, world_size, p, est.optimizer_model(opt, opt_kwargs), offload,
                                buffer_mb=cases.BUFFER_MB, device_is_host=True,
                                grad_accum_bytes=est.grad_accum_bytes(p, accum),  # zero.grad_accum_dtype unset
                                offload_params=offload_params)
        sent = est.comm_bytes(layout, stage, world_size, p, accum)
        # optimizer tensors are each rank's parts of parameters (padding in none): the estimate is the largest rank's
        assert max(r[i]["bytes"]["optimizer"] for r in reports) == want.optimizer, (stage, world_size, i)
        assert max(r[i]["offload"]["disk"] for r in reports) == want.disk, (stage, world_size, i)
        for rank, per_config in enumerate(reports):
            r = per_config[i]
            where = (f"stage {stage}, {world_size} ranks, {p.label}, offload {offload}, params offloaded "
                     f"{offload_params}, config {i}, rank {rank}")
            assert not r["skipped"], where
            assert r["bytes"] == {"params": want.params, "grads": want.grads + want.grad_accum,
                                  "optimizer": r["bytes"]["optimizer"]}, where
            assert r["bytes"]["optimizer"] <= want.optimizer and r["offload"]["disk"] <= want.disk, where
            assert r["offload"]["host"] == want.host, where
            # comm.py rounds each call (the outer units' windows are agreed on the host, not counted)
            assert abs(r["sent"] - sent) <= 8, (where, r["sent"], sent)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_predictions_equal_what_the_engine_reports(ranks, world_size, tmp_path):
    """Model-state bytes per rank equal ZeroEngine.memory_bytes() and offload_bytes() at every stage (padding
    included; optimizer and swap-file bytes: the largest rank's, which differ by padding and parameter cuts;
    frozen parameters, tied weights, several param groups, buckets and units), and bytes sent per
    step equal what zero/comm.py counts. Stronger than the 1% the estimate promises: the layout is the engine's
    own. fp32 on 1-4 ranks; on 2 and 3 ranks also bf16, fp16, zero.reduce_dtype fp32 and cpu/disk offload
    (estimate_cases.MODES), and stage 3 with its parameters offloaded to disk."""
    pool = ranks(world_size)
    for stage in range(4):
        assert_engine_reports(pool, stage, world_size)
        for precision, reduce_dtype, offload in cases.MODES.get(world_size, []):
            assert_engine_reports(pool, stage, world_size, precision, reduce_dtype, offload,
                                  str(tmp_path / "swap") if offload == "disk" else None)
    if world_size in cases.MODES:  # zero.offload_params disk (Note [Parameter offload]), optimizer disk / none
        assert_engine_reports(pool, 3, world_size, "fp32", None, "disk" if world_size == 2 else "none",
                              str(tmp_path / "swap"), offload_params=True)
    if world_size in cases.MODES:  # every engine was closed: no swap file is left
        assert [f for f in os.listdir(tmp_path / "swap") if not f.startswith(".")] == []


def test_layout_counts_and_largest_unit():
    with torch.device("meta"):
        m = cases.build("gpt", {})
    layout = est.layout_of(m, units=("Block",))
    assert layout.total == sum(p.numel() for p in m.parameters())
    assert layout.largest_unit.name == "blocks.0" and layout.largest_unit.numel == sum(
        p.numel() for p in m.blocks[0].parameters())
    with torch.device("meta"):
        frozen = cases.build("mlp", {"frozen": True})
    layout = est.layout_of(frozen)
    assert layout.frozen == 7 * 13 + 13 and layout.trainable + layout.frozen == layout.total
    complex_model = nn.Linear(2, 2)
    complex_model.c = nn.Parameter(torch.zeros(3, dtype=torch.complex64))
    with pytest.raises(ValueError, match=r"^parameter 'c' is torch.complex64: zerorun's ZeRO engine does not"):
        est.layout_of(complex_model)  # as the run refuses it (before: an estimate of a model that cannot train)
    # the largest by bytes: a float64 Linear holds twice a float32 one of as many elements (before: the first)
    wide = est.layout_of(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4).double(), nn.Linear(4, 2)), units=("Linear",))
    assert wide.largest_unit.name == "1" and wide.largest_unit.nbytes(4) == 20 * 8, wide.largest_unit


def test_activations_reduce_to_korthikanti_with_16_bit_and_dropout():
    """§4, eq. (1): s·b·h·(34 + 5·a·s/h) bytes per layer; full recomputation keeps 2·s·b·h per layer."""
    s, b, h, a, L, V = 2048, 4, 4096, 32, 24, 50000
    shape = {"n_layer": L, "d_model": h, "n_head": a, "seq_len": s, "vocab_size": V, "dropout": 0.1}
    got = est.activation_bytes(shape, micro_batch=b, element_bytes=2)
    assert got["per_layer"] == s * b * h * (34 + 5 * a * s / h)
    assert got["checkpointed"] - got["per_layer"] - got["output"] == 2 * s * b * h * L
    assert got["total_fused"] == got["total"] - L * 5 * a * s * s * b


@pytest.mark.parametrize("text,flag,value", [
    ("7B", "--params", 7 * 10**9), ("350M", "--params", 350 * 10**6), ("0.5B", "--largest-layer", 5 * 10**8),
    ("125000", "--params", 125000),
])
def test_parse_count(text, flag, value):
    assert est.parse_count(text, flag) == value


def test_parse_sizes_and_bandwidth():
    assert est.parse_bytes("80GiB") == 80 * 2**30 and est.parse_bytes("80GB") == 80 * 10**9
    assert est.parse_bytes("512 MiB") == 512 * 2**20
    assert est.parse_bandwidth("100Gbps") == 12.5e9 and est.parse_bandwidth("12.5GB/s") == 12.5e9


@pytest.mark.parametrize("flag,text,expected", [
    ("--params", "1e400", "'1e400' is too large"), ("--device-memory", "1e400GiB", "'1e400GiB' is too large"),
    ("--bandwidth", "1e400Gbps", "'1e400Gbps' is too large"), ("--params", "0.5", "expected a positive count"),
    ("--params", "1e-3", "expected a positive count"),
])
def test_sizes_out_of_range_are_one_line_errors(flag, text, expected):
    """1e400 parsed as inf and overflowed int() (a traceback); 0.5 parameters rounded to a model of 0."""
    parse = {"--params": est.parse_count, "--device-memory": est.parse_bytes, "--bandwidth": est.parse_bandwidth}
    with pytest.raises(ZerorunError, match=re.escape(f"{flag}: ") + ".*" + re.escape(expected)):
        parse[flag](text, flag)


def test_prefetch_bytes_bounds_the_gathered_working_set():
    """zero.prefetch_bytes: at most that many bytes of other listed units gathered ahead (Note [Prefetch]),
    never more than they all hold; unset: the next largest unit; 0 as prefetch off."""
    from zerorun.estimate.activations import working_set
    from zerorun.estimate.policies import PRECISIONS

    with torch.device("meta"):
        m = cases.build("gpt", {"n_layer": 4})
    layout = est.layout_of(m, units=("Block",))
    fp32 = PRECISIONS["fp32"]

    def gathered(**kw) -> int:
        return working_set(layout, 3, 2, fp32, **kw).gathered

    block = 4 * sum(-(-p.numel() // 2) * 2 for p in m.blocks[0].parameters())  # bytes, padded to 2 ranks
    one = gathered(prefetch=False)
    assert gathered() == one + block and gathered(prefetch_bytes=0) == one
    assert gathered(prefetch_bytes=block - 1) == one  # whole units only: none fits
    assert gathered(prefetch_bytes=2 * block + 5) == one + 2 * block
    assert gathered(prefetch_bytes=1 << 40) == one + 3 * block  # every other block, no more
    assert gathered(prefetch=False, prefetch_bytes=1 << 40) == one


def test_a_hosts_memory_probe_is_read_as_its_smallest_gpu_and_the_smallest_host():
    from zerorun.estimate.hosts import HostMemory, from_hosts, parse_probe

    a = parse_probe("a", "MemTotal:       2097152 kB\n81559\n40960\n")
    assert a == HostMemory(2 * 2**30, 40960 * 2**20, "cuda (nvidia-smi)")
    b = parse_probe("b", "MemTotal:       1048576 kB\n")  # no nvidia-smi: no GPU
    assert b.gpu_bytes is None
    m = from_hosts({"a": a, "b": b}, procs_per_node=2)
    assert (m.device, m.device_bytes, m.host_bytes) == ("cpu", 2**29, 2**30) and "no GPU on b" in m.source
    m = from_hosts({"a": a, "c": parse_probe("c", "MemTotal: 4194304 kB\n81559\n")}, procs_per_node=8)
    assert (m.device, m.device_bytes, m.host_bytes) == ("cuda (nvidia-smi)", 40960 * 2**20, 2 * 2**30)
    with pytest.raises(ZerorunError, match="d: cannot read its memory"):
        parse_probe("d", "sh: grep: not found\n")


def _placements_by_rank(node_ranks, group):
    """:func:`placements` counted rank by rank, as defined: the reference for the arithmetic one."""
    node_of = [i for i, k in enumerate(node_ranks) for _ in range(k)]
    world = len(node_of)
    return {(world - node_ranks[node], sum(node_of[r] != node for r in range(rank // group * group,
                                                                          rank // group * group + group)),
             sum(node_of[r] != node for r in range(rank % group, world, group))) for rank, node in enumerate(node_of)}


@pytest.mark.parametrize("node_ranks,group", [((4, 4), 2), ((4, 4, 4), 4), ((3, 5), 4), ((8,) * 6, 12),
                                              ((2, 6, 4), 6), ((1,) * 12, 3), ((5, 0, 3), 2), ((16, 16), 32)])
def test_placements_of_groups_equal_rank_by_rank_counts(node_ranks, group):
    assert set(est.hierarchy.placements(node_ranks, group)) == _placements_by_rank(node_ranks, group)


def test_the_largest_layout_takes_seconds():
    """100,000 nodes of 10 ranks, the most ranks ``--nodes`` and ``--procs-per-node`` take: the ranks per node
    and the placements in secondary groups were counted in O(nodes x ranks) (minutes at 100,000 nodes)."""
    import time

    layout = (10,) * est.sizes.MAX_NODES
    t0 = time.perf_counter()
    assert est.gradient_group(None, True, layout) == 10 and est.group_size("node", layout) == 10
    assert est.hierarchy.placements(layout, 10) == {(999_990, 0, 99_999)}
    assert est.hierarchy.placements(layout, 20) == {(999_990, 10, 49_999)}
    assert time.perf_counter() - t0 < 10


def test_stage3_sent_says_what_it_assumes_of_the_forward_order():
    """A review: a model registering its head before its blocks kept its head from forward into backward, the
    estimate counted the last block (the model's order, which is all a layout has); a frozen block behind a trainable
    embedding is gathered in backward too, counted in forward only. Both assumptions are said where they apply."""
    from zerorun.estimate.report import stage3_assumptions

    class Head(nn.Module):  # the head registered first, run last
        def __init__(self, frozen: bool = False):
            super().__init__()
            self.head = nn.Linear(8, 8)
            self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
            self.blocks[0].requires_grad_(not frozen)

    layout = est.layout_of(Head(), units=("blocks.1", "head"))
    [note] = stage3_assumptions(layout, 2, 4)
    assert note.startswith("stage 3 sent: counts blocks.1 as the unit the forward ends with, kept into backward (the "
                           "last listed unit in the model's order); the run keeps the one its forward really ends "
                           "with"), note
    assert stage3_assumptions(est.layout_of(Head(), units=("blocks.1", "head"), keep_root_bytes=0), 2, 4) == []
    notes = stage3_assumptions(est.layout_of(Head(frozen=True), units=("Linear",), keep_root_bytes=0), 2, 4)
    assert notes == ["stage 3 sent: 1 unit holding frozen parameters only (blocks.0) counted as gathered in forward "
                     "only; where a gradient flows through one (a trainable module runs before it), its backward "
                     "gathers it again"], notes
