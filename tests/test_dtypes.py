"""Parameters that are not fp32 (Note [Wide parameters] in zerorun/zero/precision.py): float64 ones stay float64
at every stage and precision and train equal to DDP over the same model; complex ones are refused naming the
parameter; integer and bool ones (frozen) keep working; checkpoints, offload and ``zerorun estimate`` count
float64 as 8 bytes.

Tolerances: with 2 ranks every gradient element is the sum of two terms, rounded once whatever the layout, so the
engine's float64 and fp32 parameters equal DDP's bit for bit (held to 1e-12 and 1e-5 relative; measured 0). The
global gradient norm sums the fp32 gradients' squares in another order than ``clip_grad_norm_`` (Note [Gradient
norm] in zerorun/zero/gradnorm.py): 1e-6. The all-float64 GPT on 3 ranks with accumulation and clipping sums in
other orders, in float64: held to 1e-12 (measured 3e-14 on parameters, 3e-16 on the norm). The multi-rank tests
start processes: marked ``slow`` (Note [Test tiers] in conftest.py); the pure ones stay in the fast tier.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import dtype_cases as cases
from parity_cases import rel
from zerorun import checkpoint
from zerorun import estimate as est
from zerorun.zero.flat import pack
from zerorun.zero.gradnorm import global_sum_of_squares
from zerorun.zero.offload import CpuMasters, DiskMasters, Masters
from zerorun.zero.precision import cast_model
from zerorun.zero.staging import typed_views

slow = pytest.mark.slow
F64, F32 = "torch.float64", "torch.float32"


# ------------------------------------------------------------------------------------------------ pure
def test_pack_puts_each_dtype_in_its_own_runs():
    """A flat buffer is one dtype: runs of each dtype in order (dtypes in order of first appearance), cut at
    ``bucket_bytes``; one dtype packs as consecutive runs, as before."""
    p = {n: nn.Parameter(torch.zeros(k, dtype=d)) for n, k, d in [
        ("a", 4, torch.float32), ("b", 2, torch.float64), ("c", 4, torch.float32), ("d", 3, torch.float64),
        ("e", 8, torch.float32)]}
    runs = pack(list(p.items()), bucket_bytes=32)
    assert [[n for n, _ in run] for run in runs] == [["a", "c"], ["e"], ["b"], ["d"]]
    one = [(n, nn.Parameter(torch.zeros(k))) for n, k in [("x", 4), ("y", 4), ("z", 1)]]
    assert [[n for n, _ in run] for run in pack(one, 32)] == [["x", "y"], ["z"]]


def test_cast_model_casts_fp32_and_leaves_float64_integers_and_bool():
    m = nn.Module()
    m.w = nn.Parameter(torch.randn(3))
    m.wide = nn.Parameter(torch.randn(3, dtype=torch.float64))
    m.count = nn.Parameter(torch.arange(2), requires_grad=False)
    m.flag = nn.Parameter(torch.tensor([True]), requires_grad=False)
    m.register_buffer("stat", torch.randn(2))
    m.register_buffer("wide_stat", torch.randn(2, dtype=torch.float64))
    wide = m.wide.detach().clone()
    assert cast_model(m, torch.bfloat16) == {"wide": torch.float64}
    assert [t.dtype for t in (m.w, m.wide, m.count, m.flag, m.stat, m.wide_stat)] == [
        torch.bfloat16, torch.float64, torch.int64, torch.bool, torch.bfloat16, torch.float64]
    assert torch.equal(m.wide, wide)


def test_parameters_the_model_made_in_a_2_byte_dtype_are_named_when_cast():
    """A review: a model built in bf16 was silently trained in fp32 at the default precision (twice its memory, other
    numbers; a forward casting its inputs to bf16 then failed on mat1 and mat2's dtypes). The cast stays (the
    precision is the recipe's), and rank 0's warning names them and the way to keep them."""
    from zerorun.zero.precision import cast_and_report

    m = nn.Module()
    m.a = nn.Linear(2, 2).bfloat16()
    m.b = nn.Linear(2, 2)
    m.wide = nn.Parameter(torch.randn(3, dtype=torch.float64))
    kept, warning = cast_and_report(m, torch.float32, "fp32")
    assert kept == {"wide": torch.float64} and m.a.weight.dtype == torch.float32
    assert warning == ("precision fp32 casts parameters the model made in another dtype to torch.float32: a.weight "
                       "(bfloat16), a.bias (bfloat16) (set precision to theirs, bf16 or fp16, to train in it)")
    m.a.half()
    kept, warning = cast_and_report(m, torch.bfloat16, "bf16")
    assert warning == ("precision bf16 casts the floating parameters to torch.bfloat16 except 1 kept in their own "
                       "dtype (computed, reduced and stepped in it): wide (float64); precision bf16 casts parameters "
                       "the model made in another dtype to torch.bfloat16: a.weight (float16), a.bias (float16) (set "
                       "precision to theirs, bf16 or fp16, to train in it)")
    assert cast_and_report(nn.Linear(2, 2), torch.float32, "fp32") == ({}, None)


def test_gradient_norm_sums_float64_gradients_in_float64():
    """Values 1 + k·1e-9: fp32 squares would lose the 1e-9 part (fp32's ulp at 1 is 1.2e-7)."""
    small = 1 + 1e-9 * torch.arange(100, dtype=torch.float64)
    large = 1 + 1e-9 * torch.arange(10_000, dtype=torch.float64)
    want = sum(float((t ** 2).sum()) for t in (small, large))
    got = global_sum_of_squares([small, large])
    assert got.dtype == torch.float64 and rel(float(got), want) <= 1e-14


def test_typed_views_group_dtypes_in_one_allocation():
    storage, views, flats = typed_views([3, 2, 4], [torch.float32, torch.float64, torch.float32])
    assert [(v.dtype, v.numel()) for v in views] == [(torch.float32, 3), (torch.float64, 2), (torch.float32, 4)]
    assert [(f.dtype, f.numel()) for f in flats] == [(torch.float32, 7), (torch.float64, 2)]
    assert all(v.untyped_storage().data_ptr() == storage.untyped_storage().data_ptr() for v in views)
    one, views, flats = typed_views([3, 4], [torch.float32] * 2)
    assert one.dtype == torch.float32 and one.numel() == 7 and flats[0] is one


@pytest.mark.parametrize("offload", ["none", "cpu", "disk"])
def test_a_float64_slice_gets_a_float64_master(tmp_path, offload):
    """A float64 slice (near 1e8, paged in several sub-groups on disk) beside a bf16 one: its master and AdamW
    states are float64 and its steps equal torch's AdamW in float64; the bf16 one's, on an fp32 master."""
    torch.manual_seed(0)
    slices = [1e8 + torch.randn(97, dtype=torch.float64), torch.randn(20).to(torch.bfloat16)]
    refs = [slices[0].clone().requires_grad_(True), slices[1].float().requires_grad_(True)]
    kwargs = {"folder": str(tmp_path), "buffer_bytes": 2048, "rank": 0} if offload == "disk" else {}
    masters = {"none": Masters, "cpu": CpuMasters, "disk": DiskMasters}[offload](
        slices, [0, 0], [{"lr": 1e-3, "weight_decay": 0.1}], torch.optim.AdamW, {}, **kwargs)
    opt = torch.optim.AdamW(refs, lr=1e-3, weight_decay=0.1)
    for step in range(3):
        grads = [torch.randn(97, dtype=torch.float64), torch.randn(20).to(torch.bfloat16)]
        masters.step(grads, None)
        for r, g in zip(refs, grads):
            r.grad = g.to(r.dtype)
        opt.step()
    got = masters.master_slices()
    assert [t.dtype for t in got] == [torch.float64, torch.float32]
    assert rel(got[0] - 1e8, refs[0].detach() - 1e8) <= 1e-12 and rel(got[1], refs[1].detach()) <= 1e-6
    assert torch.equal(slices[0], got[0]) and torch.equal(slices[1], got[1].to(torch.bfloat16))
    assert {str(v.dtype) for s in masters.state_slices()[:1] for k, v in s.items() if k != "step"} == {F64}
    masters.close()


# ------------------------------------------------------------------------------------------- multi-rank
def _check_parity(results: list[dict], fp32: bool = True) -> None:
    for rank, r in enumerate(results):
        assert r["masters"] == ([F32, F64] if fp32 else [F64]) and r["norm_dtype"] == F64, (rank, r)
        assert {d for n, d in r["dtypes"].items() if n in cases.WIDE or not fp32} == {F64}, (rank, r)
        assert r["params"][F64] <= 1e-12 and max(r["moved"].values()) <= 1e-12, (rank, r)
        assert r["loss"] <= 1e-12 and r["start"], (rank, r)
        if fp32:
            assert r["params"][F32] <= 1e-5 and r["grad_norm"] <= 1e-6, (rank, r)
            assert r["equal_non_float"] == [True, True], (rank, r)  # the integer and the bool parameter
        else:
            assert r["grad_norm"] <= 1e-12, (rank, r)


@slow
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_float64_parameters_stay_float64_and_train_equal_to_ddp(ranks, stage):
    """fp32 training of :class:`dtype_cases.Wide`: before, its float64 parameters were cast to fp32 and their
    change over 10 steps was 0.94 (``mix``) to 100 (``offset``) relative off DDP's."""
    _check_parity(ranks(2).run(cases.parity, stage=stage))


@slow
def test_a_unit_of_float32_float64_and_integer_parameters_trains_equal_to_ddp(ranks):
    """A stage-3 unit whose parameters are float32, float64 and integer (:class:`dtype_cases.MixedBlock`): its
    three buffers are all-gathered in one collective, as bytes (Note [One all-gather per unit]). Before: torch's
    coalesced all-gather on gloo mixed the dtypes up, the first loss came out 2x DDP's and then NaN."""
    for rank, r in enumerate(ranks(2).run(cases.parity, stage=3, kind="blocks", units=("MixedBlock",))):
        assert r["loss"] <= 1e-6 and r["grad_norm"] <= 1e-5 and r["start"], (rank, r)
        assert r["params"][F32] <= 1e-5 and r["params"][F64] <= 1e-10, (rank, r)
        assert r["equal_non_float"] == [True, True, True], (rank, r)  # the blocks' integers and the bool


@slow
@pytest.mark.parametrize("stage", [2, 3])
def test_all_float64_model_on_three_ranks_with_accumulation_and_clipping(ranks, stage):
    _check_parity(ranks(3).run(cases.parity, stage=stage, kind="gpt64", accum=2, clip=0.05, steps=8), fp32=False)


@slow
@pytest.mark.parametrize("stage,offload", [(2, "cpu"), (1, "disk"), (3, "disk")])
def test_offloaded_float64_masters_train_equal_to_ddp(ranks, tmp_path, stage, offload):
    _check_parity(ranks(2).run(cases.parity, stage=stage, offload=offload, offload_path=str(tmp_path)))


@slow
@pytest.mark.parametrize("stage,precision", [(0, "bf16"), (3, "bf16"), (2, "fp16")])
def test_mixed_precision_leaves_float64_alone_and_says_so_once(ranks, stage, precision):
    """The fp32 parameters are cast to the 2-byte dtype, the float64 ones stay float64 (float64 masters), rank 0
    warns once naming them, and training equals the same recipe by hand over DDP (measured: 0)."""
    low = {"bf16": "torch.bfloat16", "fp16": "torch.float16"}[precision]
    results = ranks(2).run(cases.mixed, stage=stage, precision=precision)
    assert len(results[0]["warned"]) == 1 and results[1]["warned"] == []
    assert "mix (float64), offset (float64)" in results[0]["warned"][0], results[0]["warned"]
    for r in results:
        assert r["kept"] == {"mix": "float64", "offset": "float64"} and r["masters"] == [F32, F64], r
        assert {n: d for n, d in r["dtypes"].items() if d != low} == {
            "mix": F64, "offset": F64, "count": "torch.int64", "flag": "torch.bool"}, r
        assert r["params"][F64] <= 1e-12 and r["params"][low] == 0.0 and r["loss"] <= 1e-12, r


@slow
@pytest.mark.parametrize("stage,deferred", [(0, False), (1, False), (2, False), (3, False), (3, True)])
def test_a_complex_parameter_is_refused_naming_it_on_every_rank(ranks, stage, deferred):
    """One ValueError from initialize naming the parameter and its dtype, before any collective: the ranks'
    next collective still pairs up (before: an error naming no parameter, or none until training at stage 3)."""
    for r in ranks(2).run(cases.refused, stage=stage, deferred=deferred):
        assert r["error"] is not None and r["error"].startswith("parameter 'phase' is torch.complex64"), r
        assert r["sum"] == 3.0


CHECKPOINTS = {  # stage, zero fields, stage to resume at (None: the same)
    "stage2": (2, {}, None), "stage3": (3, {}, None), "stage0-to-stage3": (0, {}, 3),
    "disk-stage1": (1, {"offload_optimizer": "disk", "offload_buffer_mb": 0.0015}, None),
    "bf16-cpu-stage2": (2, {"precision": "bf16", "offload_optimizer": "cpu"}, None),
}


@slow
@pytest.mark.parametrize("case", list(CHECKPOINTS))
def test_checkpoints_resume_float64_parameters_exactly(ranks, tmp_path, case):
    """Masters (float64 for the float64 parameters), optimizer states and parameters right after the load equal
    those at the save bit for bit, and the resumed run's losses the uninterrupted run's; consolidation writes the
    float64 parameters as float64."""
    stage, zero, resume = CHECKPOINTS[case]
    if zero.get("offload_optimizer") == "disk":
        zero = dict(zero, offload_path=str(tmp_path / "swap"))
    results = ranks(2).run(cases.save_and_resume, root=str(tmp_path / "ckpt"), stage=stage, zero=zero,
                           resume_stage=resume)
    for r in results:
        assert r["masters"] == [F32, F64] and r["wide_dtypes"] == [F64, F64], r
        assert r["full_loaded"] and r["full_end"] and r["resumed"] == r["losses"], r
        if resume is None:
            assert r["masters_loaded"] and r["optim_loaded"] and r["masters_end"], r
    out = str(tmp_path / "model.pt")
    checkpoint.consolidate(results[0]["path"], out)
    state = torch.load(out)
    assert {k: str(v.dtype) for k, v in state.items() if k in cases.WIDE} == {"mix": F64, "offset": F64}
    assert state["count"].dtype == torch.int64 and state["flag"].dtype == torch.bool


ESTIMATE_MODES = [("fp32", None, "none", 1), ("bf16", None, "cpu", 2), ("fp32", None, "disk", 1),
                  ("bf16", "fp32", "disk", 1), ("fp16", None, "none", 2)]


@slow
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_estimate_counts_float64_buffers_as_the_engine_holds_them(ranks, tmp_path, stage):
    """``zerorun estimate`` predicts the model-state bytes and bytes sent of :class:`dtype_cases.Wide` exactly
    (float64 buffers 8 bytes per element: parameters, gradients, masters, states, swap file; before, 4 or 2)."""
    pool = ranks(2)
    with torch.device("meta"):
        model = cases.Wide()
    for precision, reduce_dtype, offload, accum in ESTIMATE_MODES:
        swap = str(tmp_path / "swap") if offload == "disk" else None
        reports = pool.run(cases.engine_bytes, stage=stage, precision=precision, reduce_dtype=reduce_dtype,
                           offload=offload, offload_path=swap, accum=accum)
        layout = est.layout_of(model, bucket_mb=0.0005, precision=precision)
        p = est.precision_of(precision, reduce_dtype)
        want = est.model_states(layout, stage, 2, p, est.optimizer_model("AdamW"), offload, buffer_mb=0.002,
                                device_is_host=True, grad_accum_bytes=est.grad_accum_bytes(p, accum))
        where = (stage, precision, reduce_dtype, offload)
        assert max(r["bytes"]["optimizer"] for r in reports) == want.optimizer, (where, reports, want)
        assert max(r["offload"]["disk"] for r in reports) == want.disk, (where, reports, want)
        for r in reports:
            assert not r["skipped"], where
            assert (r["bytes"]["params"], r["bytes"]["grads"]) == (want.params, want.grads + want.grad_accum), (
                where, r, want)
            assert r["offload"]["host"] == want.host, (where, r, want)
            assert abs(r["sent"] - est.comm_bytes(layout, stage, 2, p, accum)) <= 8, (where, r)
