"""Stage 3's parameter offload to disk (``zero.offload_params: disk``, Note [Parameter offload] in
zerorun/zero/param_offload.py): same numbers as stage 0, no parameter slice resident between uses, the swap
file removed at close, checkpoints across offload and none (recipe fields: tests/test_recipe.py)."""

import pytest

import param_offload_cases as cases
from zerorun.zero import ZeroConfig


def _close(a, b):
    return len(a) == len(b) and all(abs(x - y) <= 1e-5 * max(1.0, abs(y)) for x, y in zip(a, b))


@pytest.mark.slow
def test_offloaded_parameters_train_to_stage0s_numbers_and_leave_nothing_resident(ranks, tmp_path):
    for r in ranks(2).run(cases.offload_params_run, root=str(tmp_path / "ckpt"), swap=str(tmp_path / "swap")):
        ref = r["stage0"]
        assert _close(r["offload"], ref), (r["offload"], ref)
        assert _close(r["both"], ref), (r["both"], ref)
        assert _close(r["resumed_without"], ref[2:]), (r["resumed_without"], ref)
        assert _close(r["resumed_with_both"], ref[2:]), (r["resumed_with_both"], ref)
        assert r["file_while_running"] and r["file_after_close"] == 0, r
        assert r["slice_bytes"] > 0 and r["resident_after_step"] == 0, r  # None: no mapping found
        assert r["resident_touched"] >= r["slice_bytes"] and r["resident_released"] == 0, r
        assert r["memory_params"] == 0 and r["offload_disk"] >= r["slice_bytes"], r


@pytest.mark.slow
def test_a_model_built_on_the_meta_device_replays_into_the_offloaded_slices(ranks, tmp_path):
    for r in ranks(2).run(cases.deferred_offload, swap=str(tmp_path / "swap")):
        assert _close(r["offload"], r["stage0"]), r


def test_engine_config_is_checked():
    with pytest.raises(ValueError, match="needs zero.stage 3"):
        ZeroConfig(stage=2, offload_params="disk", offload_path="/tmp")
    with pytest.raises(ValueError, match="must be none or disk"):
        ZeroConfig(stage=3, offload_params="nvme", offload_path="/tmp")
