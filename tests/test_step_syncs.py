"""No host sync in the optimizer step (issue 33 item 3, the step's part): at stages 0-2, fp32 and bf16, the
step (global norm, clipping, the optimizer, the write back and the all-gather) reads no tensor value to the
host; fp16 reads one, the overflow decision (Note [Loss scaling]). The step returns the norm as a 0-d tensor.
One optimizer step per engine step (item 4), multi-tensor; cpu offload's staging buffers reused (item 6).
Scalar optimizer states (Adam's ``step``) stay on the CPU after a resume, as torch keeps them (item 7), and the
next step reads none of them on the device."""

import pytest

import step_sync_cases as cases

pytestmark = pytest.mark.slow

BOUND = {"fp32": 0, "bf16": 0, "fp16": 1}
CONFIGS = [(stage, {"precision": precision}) for stage in (0, 1, 2) for precision in ("fp32", "bf16", "fp16")]
CONFIGS += [(2, {"precision": "bf16", "offload_optimizer": "cpu"}), (1, {"precision": "fp32", "offload_optimizer": "cpu"}),
            (2, {"precision": "bf16", "offload_optimizer": "disk"})]


def _explain(config, r) -> str:
    sites = ", ".join(f"{site} x{n}" for site, n in sorted(r["sites"].items())) or "none"
    return f"stage {config[0]} {config[1]}: {r['count']} host reads in the step at {sites}"


def test_optimizer_step_reads_nothing_to_the_host(ranks, tmp_path):
    results = ranks(2).run(cases.step_syncs, configs=CONFIGS, swap=str(tmp_path / "swap"))
    for rank, per_config in enumerate(results):
        for config, r in zip(CONFIGS, per_config):
            assert r["count"] <= BOUND[config[1]["precision"]], f"rank {rank}: {_explain(config, r)}"
            assert r["norm_type"] == "Tensor" and not r["skipped"] and r["norm"] > 0.05, (rank, config, r)
            offload = config[1].get("offload_optimizer")
            if offload != "disk":  # item 4: one optimizer step over every buffer (disk: one per paged sub-group)
                assert r["buffers"] > 1 and r["optimizer_steps"] == 1, (rank, config, r)
            # item 6: the host step fused (AdamW has the CPU kernel), else foreach; cpu offload's staging reused
            want = {"foreach": None, "fused": True} if offload else {"foreach": True, "fused": None}
            assert r["kwargs"] == want and r["staging_reused"] == (offload == "cpu"), (rank, config, r)


RESUMED = [(2, {"precision": "fp32"}), (1, {"precision": "bf16"}), (2, {"precision": "bf16", "offload_optimizer": "cpu"})]


def test_resumed_scalar_states_stay_on_the_cpu(ranks, tmp_path):
    for rank, per_config in enumerate(ranks(2).run(cases.resumed_scalars, root=str(tmp_path), configs=RESUMED)):
        for config, r in zip(RESUMED, per_config):
            assert r["n_scalars"] > 0 and r["scalars"] == [("cpu", "torch.float32")], (rank, config, r)
            assert r["count"] == 0, f"rank {rank}: {_explain(config, r)}"


@pytest.mark.parametrize("stage", [0, 2])
def test_resume_loads_scalar_states_on_the_cpu_whatever_the_masters_device(ranks, stage):
    """Resume made them on the masters' device (a GPU: a host read per parameter per step afterwards)."""
    for rank, devices in enumerate(ranks(2).run(cases.scalar_targets_of_a_device_engine, stage=stage)):
        assert devices and set(devices) == {"cpu"}, f"rank {rank}: scalar state targets on {sorted(set(devices))}"
