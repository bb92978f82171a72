"""Checkpoints of a disk-offloaded engine are streamed through its paging buffer (Note [Paged checkpoints] in
zero/state_paging.py): host memory during save and load stays within the buffer, resume is bit-exact, and the
checkpoints load into engines without offload (and the other way round)."""

import disk_checkpoint_cases as cases


def test_save_and_load_stay_within_the_paging_buffer(ranks, tmp_path):
    """Stage 2, AdamW, 2 ranks: 1.5 MiB of masters and states per rank, a 0.25 MiB buffer."""
    for rank, r in enumerate(ranks(2).run(cases.peak_extra_bytes, root=str(tmp_path / "ckpt"),
                                          swap=str(tmp_path / "swap"))):
        assert r["slices"] > 4 * r["buffer"], r  # reading the slices whole would break the bound
        assert r["save"] <= r["buffer"] and r["load"] <= r["buffer"], f"rank {rank}: {r}"
        assert r["restored"], r


def test_disk_checkpoints_load_into_other_engines_and_back(ranks, tmp_path):
    for r in ranks(2).run(cases.across_offload, root=str(tmp_path / "ckpt"), swap=str(tmp_path / "swap")):
        assert all(r.values()), r


def test_a_state_this_optimizer_does_not_keep_is_a_one_line_error(ranks, tmp_path):
    for msg in ranks(2).run(cases.another_optimizer_state, root=str(tmp_path / "ckpt"), swap=str(tmp_path / "swap")):
        assert msg is not None and "\n" not in msg and msg.endswith(
            "zerorun.json: another optimizer: optimizer state 'max_exp_avg_sq' in the checkpoint is not one of this "
            "optimizer's per-element states (exp_avg, exp_avg_sq)"), msg
