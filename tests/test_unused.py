"""A parameter no rank uses in a step is not stepped, as under DDP (``find_unused_parameters=True``) with
torch's optimizers (Note [Unused parameters] in zerorun/zero/masters.py); resumed checkpoints keep each
parameter's own step count."""

import pytest

import unused_cases as cases

pytestmark = pytest.mark.slow

TOL = 1e-5


def check(results: list[dict]) -> None:
    for rank, r in enumerate(results):
        assert r["rel"] <= TOL and r["c_moved"] == 0.0, f"rank {rank}: {r}"


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_alternating_blocks_adamw_match_ddp(ranks, stage):
    check(ranks(2).run(cases.alternating, stage=stage))


@pytest.mark.parametrize("stage,optimizer,kwargs,zero,accum", [
    (1, "SGD", {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.1}, {}, 1),
    (2, "Adam", {"lr": 1e-2, "weight_decay": 0.1}, {}, 2),
    (0, "AdamW", {"lr": 1e-2, "weight_decay": 0.1}, {"offload_optimizer": "cpu"}, 1),
    (2, "RMSprop", {"lr": 1e-2, "momentum": 0.5, "weight_decay": 0.1}, {"offload_optimizer": "cpu"}, 1),
    (3, "AdamW", {"lr": 1e-2, "weight_decay": 0.1}, {"offload_optimizer": "disk", "offload_buffer_mb": 0.001}, 1),
], ids=["sgd-momentum", "adam-accum", "cpu-offload", "rmsprop-cpu-offload", "disk-offload"])
def test_other_optimizers_accumulation_and_offload(ranks, tmp_path, stage, optimizer, kwargs, zero, accum):
    if zero.get("offload_optimizer") == "disk":
        zero = dict(zero, offload_path=str(tmp_path))
    check(ranks(2).run(cases.alternating, stage=stage, optimizer=optimizer, kwargs=kwargs, zero=zero, accum=accum))


@pytest.mark.parametrize("save_stage,load_stage,save_at,zero", [
    (1, 2, 1, {}),  # b never stepped at the save: it loads as no state
    (0, 3, 3, {}),  # a stepped twice, b once: each its own step count
    (2, 1, 3, {"offload_optimizer": "disk", "offload_buffer_mb": 0.001}),
], ids=["never-stepped", "per-parameter-steps", "into-disk-offload"])
def test_resume_keeps_per_parameter_steps(ranks, tmp_path, save_stage, load_stage, save_at, zero):
    if zero.get("offload_optimizer") == "disk":
        zero = dict(zero, offload_path=str(tmp_path / "swap"))
    check(ranks(2).run(cases.resumed, root=str(tmp_path / "ckpt"), save_stage=save_stage, load_stage=load_stage,
                       save_at=save_at, zero=zero))


@pytest.mark.parametrize("stage,precision", [(0, "fp32"), (1, "fp32"), (3, "fp32"), (2, "bf16")])
def test_optimizer_zero_grad_in_the_loop_changes_nothing(ranks, stage, precision):
    for rank, r in enumerate(ranks(2).run(cases.zero_grad_loop, stage=stage, precision=precision)):
        assert r["moved"] > 0.01 and r["differ"] == 0.0, f"rank {rank}: {r}"


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_narrow_grad_accum_dtype_steps_the_reduced_gradient(ranks, stage):
    """Stage 1 stepped this rank's unreduced gradient of the last micro-step (0.28 off on this input)."""
    for rank, r in enumerate(ranks(2).run(cases.accum_dtype_step, stage=stage)):
        assert r["error"] <= 1e-6, f"rank {rank}: {r}"
