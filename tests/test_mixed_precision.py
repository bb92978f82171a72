"""Mixed precision (bf16, fp16) and optimizer offload (cpu, disk) in zerorun's ZeRO engine.

Note [Mixed-precision tolerances]: the reference (``mixed_cases.MixedReference``) is the same recipe written
out by hand over torch's DDP: a 2-byte model, 2-byte gradient all-reduce, one fp32 master per parameter,
unscale and clip in fp32, cast back. With 2 ranks and no accumulation every gradient element is the sum of
two terms, rounded once to the 2-byte dtype whatever the bucket layout, so the engine's 2-byte gradients,
fp32 masters and 2-byte parameters equal the reference's bit for bit (held to 0); only the global gradient
norm is summed in another fp32 order (per flat buffer vs per parameter), held to 1e-6 relative (a few fp32
ulps). With 3 ranks and accumulation the 2-byte sums are rounded in a different order (ring reduce-scatter vs
ring all-reduce; stage 2 reduces every micro-step): a 2-byte rounding step is 2**-8 (bf16) or 2**-11 (fp16)
relative, which Adam turns into lr-sized steps for near-zero gradients. Those cases are held to 4x the
distance between two DDP references that differ only in summation order (measured in the same run; about
1e-3 of the model's largest master), and never tighter than one 2-byte ulp of the largest parameter
(``torch.finfo(dtype).eps``) for parameters, masters and the 2-byte loss. Parameters and masters are
compared over the whole model (max |difference| / max |reference|), see ``mixed_cases._model_rel``.
Offload changes where the optimizer runs, not its arithmetic: it is held to 1e-6 (fp32 and bf16; measured 0).
"""

import os
import subprocess
import sys

import pytest
import torch

import mixed_cases
import parity_cases as cases
from zerorun.zero.offload import DiskMasters, Masters, SwapFile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EPS = {"bf16": torch.finfo(torch.bfloat16).eps, "fp16": torch.finfo(torch.float16).eps}


def _units(stage):
    return ("Block",) if stage == 3 else ()


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_mixed_precision_matches_ddp_exactly_on_two_ranks(ranks, stage, precision):
    for rank, r in enumerate(ranks(2).run(mixed_cases.parity_mixed, stage=stage, precision=precision, clip=1.0,
                                          units=_units(stage))):
        assert r["dtypes"] == [{"bf16": "torch.bfloat16", "fp16": "torch.float16"}[precision]], r
        assert r["loss"] == r["params"] == r["masters"] == 0.0, f"rank {rank}: {r}"
        assert r["grad_norm"] <= 1e-6, f"rank {rank}: {r}"
        assert r["skipped"]["engine"] == r["skipped"]["ref"], f"rank {rank}: {r}"
        assert r["loss_scale"][1] == (r["loss_scale"][0] if precision == "fp16" else None)


def test_stage3_meta_init_bf16_matches_ddp_exactly(ranks):
    for r in ranks(2).run(mixed_cases.parity_mixed, stage=3, precision="bf16", units=("Block",), deferred=True):
        assert r["params"] == r["masters"] == 0.0 and r["grad_norm"] <= 1e-6, r


@pytest.mark.parametrize("stage,precision", [(2, "bf16"), (3, "bf16"), (1, "fp16")])
def test_mixed_precision_three_ranks_accumulation_clipping(ranks, stage, precision):
    for rank, r in enumerate(ranks(3).run(mixed_cases.parity_mixed, stage=stage, precision=precision, accum=2,
                                          clip=0.05, units=_units(stage))):
        assert r["floor_masters"] < 1e-2, f"rank {rank}: floor implausibly large: {r}"
        for key, base in (("loss", EPS[precision]), ("params", EPS[precision]), ("masters", EPS[precision]),
                          ("grad_norm", 1e-5)):
            tol = max(base, 4 * r["floor_" + key])
            assert r[key] <= tol, f"rank {rank}: {key} differs by {r[key]:.3g} > {tol:.3g}: {r}"
        assert r["skipped"]["engine"] == r["skipped"]["ref"]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_reduce_dtype_fp32_matches_an_fp32_all_reduce(ranks, stage):
    """``zero.reduce_dtype: fp32`` against a reference that all-reduces each bf16 gradient cast to fp32."""
    for r in ranks(2).run(mixed_cases.parity_mixed, stage=stage, precision="bf16", reduce_dtype="fp32",
                          units=_units(stage)):
        assert r["params"] == r["masters"] == 0.0 and r["grad_norm"] <= 1e-6, r


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_fp16_overflow_on_one_rank_skips_the_step_on_every_rank(ranks, stage):
    """An inf in one gradient element on rank 0 only (before any reduction), at step 2 of 5; loss scale starts
    at 1024 and grows every 2 good steps."""
    results = ranks(2).run(mixed_cases.overflow, stage=stage, inject_step=2, steps=5)
    assert results[0] == results[1]  # every rank took the same decisions
    rows, total = results[0][:-1], results[0][-1]
    assert [r["skipped"] for r in rows] == [False, False, True, False, False]
    assert [r["scale"] for r in rows] == [1024.0, 2048.0, 1024.0, 1024.0, 2048.0]
    assert not rows[2]["finite"] and not rows[2]["masters_changed"] and not rows[2]["params_changed"]
    assert all(r["masters_changed"] and r["params_changed"] for i, r in enumerate(rows) if i != 2)
    assert [r["adam_steps"] for r in rows] == [[1], [2], [2], [3], [4]]  # the optimizer did not step either
    assert total == {"skipped_steps": 1}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_mixed_precision_bytes_match_zero_paper(ranks, stage):
    """ZeRO §3.1 and §5, bf16 with AdamW (K = 12: fp32 master, momentum, variance): stage 0 2Ψ + 2Ψ + 12Ψ;
    stage 1 2Ψ + 2Ψ + 12Ψ/N; stage 2 2Ψ + 2Ψ/N + 12Ψ/N; stage 3 (2Ψ + 2Ψ + 12Ψ)/N (Ψ with padding). Bytes
    sent per step: the fp32 case's elements (test_zero_parity.test_bytes_sent_per_step) at 2 bytes each."""
    for r in ranks(3).run(cases.memory, stage=stage, units=_units(stage), precision="bf16"):
        n, padded = r["world_size"], r["padded"]
        expected = cases.paper_bytes(stage, padded, n, 2, 2, 12)
        got = r["bytes"]
        assert (got["params"], got["grads"]) == expected[:2]
        assert expected[2] <= got["optimizer"] <= expected[2] + 4 * 64  # plus AdamW's 4-byte step counters
        sent = ((3 if stage == 3 else 2) * padded - r["kept"]) * (n - 1) // n * 2  # the kept units: once
        # the norm all-reduce: 8 bytes (fp64); stage 3's unit digest is agreed on the host, not counted (Note
        # [Agreements on the host] in zerorun/zero/comm.py)
        assert r["comm"]["bytes_sent"] == sent + (0 if stage == 0 else round(2 * (n - 1) / n * 8))


@pytest.mark.parametrize("offload", ["cpu", "disk"])
@pytest.mark.parametrize("stage,precision", [(1, "fp32"), (3, "fp32"), (2, "bf16")])
def test_offload_equals_no_offload(ranks, tmp_path, stage, precision, offload):
    path = str(tmp_path / "swap") if offload == "disk" else None
    for r in ranks(2).run(mixed_cases.offload_equal, stage=stage, precision=precision, offload=offload,
                          offload_path=path):
        for key in ("loss", "grad_norm", "params", "masters", "states"):
            assert r[key] <= 1e-6, f"{key}: {r}"
        if offload == "disk":
            assert r["memory"]["disk"]["optimizer"] == 0 and r["optimizer_state_len"] == 0, r
            # the host buffer (0.02 MiB) is all the host memory the optimizer states get
            assert r["memory"]["offload"]["host"] <= 0.02 * 2**20 < r["memory"]["offload"]["disk"], r
            assert r["swap_file_existed"] and not r["swap_file_after_close"], r
        else:
            assert r["memory"]["cpu"]["optimizer"] >= r["memory"]["none"]["optimizer"], r


_SWAP_SCRIPT = """
import sys, time
from zerorun.zero.offload import DiskMasters, SwapFile
f = SwapFile(sys.argv[1], int(sys.argv[2]))
f.write(f.allocate(64), __import__("torch").ones(16))
print(f.path, flush=True)
if sys.argv[3] == "wait":
    time.sleep(120)
"""


def _swap_process(folder, rank: int, mode: str) -> tuple[subprocess.Popen, str]:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-c", _SWAP_SCRIPT, str(folder), str(rank), mode],
                            stdout=subprocess.PIPE, text=True, env=env)
    return proc, proc.stdout.readline().strip()


def test_swap_files_removed_at_exit_and_after_a_crash(tmp_path):
    """Note [Swap files]: a normal exit removes the file; a SIGKILLed run leaves it, and the next run in the
    folder removes it, but never the file of a run that is still alive."""
    done, done_path = _swap_process(tmp_path, 0, "exit")
    assert done.wait(timeout=120) == 0 and done_path and not os.path.exists(done_path)
    crashed, stale = _swap_process(tmp_path, 0, "wait")
    live, live_path = _swap_process(tmp_path, 1, "wait")
    try:
        crashed.kill()
        crashed.wait(timeout=60)
        assert os.path.exists(stale) and os.path.exists(live_path)
        f = SwapFile(str(tmp_path), 2)
        assert f.removed_stale == [stale] and not os.path.exists(stale) and os.path.exists(live_path)
        f.close()
        assert not os.path.exists(f.path)
    finally:
        live.kill()
        live.wait(timeout=60)


@pytest.mark.parametrize("tag", ["", "params-"])
def test_two_swap_files_of_one_process_and_rank_keep_their_data(tmp_path, tag):
    """Two engines of one process and rank (a notebook, a test) offloading into one folder: the second gets
    its own file; it used to reopen the first's with O_TRUNC (a mapped parameter file then faults with
    SIGBUS) and fail on the lock."""
    import torch

    first = SwapFile(str(tmp_path), 0, tag=tag)
    offset = first.allocate(64)
    first.write(offset, torch.arange(16, dtype=torch.float32))
    second = SwapFile(str(tmp_path), 0, tag=tag)
    back = torch.zeros(16)
    first.read_into(offset, back)
    assert second.path != first.path and torch.equal(back, torch.arange(16, dtype=torch.float32))
    second.close()
    first.close()
    assert not os.path.exists(first.path) and not os.path.exists(second.path)


@pytest.mark.slow
def test_zerorun_train_fp16_with_disk_offload(tmp_path):
    """The whole path: recipe fields -> worker -> engine; step events carry the loss scale and skips; the
    swap folder is empty when the job ends."""
    swap = tmp_path / "swap"
    out = subprocess.run([sys.executable, "-m", "zerorun", "train", os.path.join(ROOT, "recipes/tiny.yaml"),
                          f"log.dir={tmp_path / 'runs'}", "precision=fp16", "train.steps=12", "log.every=1",
                          "train.eval_every=0", "zero.offload_optimizer=disk", f"zero.offload_path={swap}",
                          "zero.offload_buffer_mb=0.05", "loss_scale.growth_interval=4",
                          "loss_scale.initial_scale=4194304"],
                         cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    [metrics] = list((tmp_path / "runs").glob("*/*/metrics.jsonl"))
    import json

    events = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [e for e in events if e["event"] == "step" and e["rank"] == 0]
    assert [e["step"] for e in steps] == list(range(1, 13))
    assert all(isinstance(e["skipped"], bool) and e["loss_scale"] >= 1.0 for e in steps)
    assert steps[-1]["skipped_steps"] == sum(e["skipped"] for e in steps)
    # a skipped step does not advance the learning-rate schedule (recipes/tiny.yaml: lr 3e-3, 3 warm-up steps)
    from zerorun.recipe import ScheduleSpec
    from zerorun.rank.schedule import lr_multiplier

    f = lr_multiplier(ScheduleSpec(warmup_steps=3), 12)
    taken = [sum(not e["skipped"] for e in steps[:i]) for i in range(len(steps))]
    assert 0 < steps[-1]["skipped_steps"] < 10, steps  # the large first scale overflows a few times
    assert [e["lr"] for e in steps] == pytest.approx([3e-3 * f(k) for k in taken], rel=1e-6)
    assert steps[-1]["loss"] < steps[0]["loss"]
    assert steps[0]["model_state_bytes"]["optimizer"] == 0  # all of it in the swap file
    assert [f for f in os.listdir(swap) if not f.startswith(".")] == []


def test_disk_offload_with_a_stateless_optimizer_steps_like_no_offload(tmp_path):
    """SGD without momentum keeps no state at all: paging it through the swap file must still step (it raised
    KeyError) and give the same masters as no offload."""
    grads = [torch.linspace(-1, 1, 40)]
    masters = []
    for make in (lambda s: Masters(s, [0], [{}], torch.optim.SGD, {"lr": 0.1}),
                 lambda s: DiskMasters(s, [0], [{}], torch.optim.SGD, {"lr": 0.1}, folder=str(tmp_path),
                                       buffer_bytes=2**8, rank=0)):
        m = make([torch.arange(40, dtype=torch.float32)])
        for _ in range(2):
            m.step(grads, None)
        masters.append(m.master_slices()[0])
        assert m.state_slices() == [{}] * len(m.state_slices())
        m.close()
    assert torch.equal(masters[0], masters[1])


def test_disk_offload_bad_folder_or_buffer_is_a_one_line_error(tmp_path):
    (tmp_path / "file").write_text("")
    args = ([torch.zeros(40)], [0], [{}], torch.optim.AdamW, {"lr": 1e-3})
    with pytest.raises(ValueError, match=r"^zero\.offload_path: cannot create a swap file in .*file/sub: Not a directory$"):
        DiskMasters(*args, folder=str(tmp_path / "file" / "sub"), buffer_bytes=2**16, rank=0)
    with pytest.raises(ValueError, match=r"zero\.offload_buffer_mb: 100 bytes cannot page"):
        DiskMasters(*args, folder=str(tmp_path / "swap"), buffer_bytes=100, rank=0)
