"""ZeRO++'s hierarchical partitioning (hpZ, ``zero.hierarchy``; Note [Secondary shards] in
zerorun/zero/hierarchy.py): the same training as flat stage 3, bit for bit, with the backward all-gathers kept
inside a node; and what it refuses."""

import pytest

import hierarchy_cases as cases
from test_zero_parity import check


@pytest.mark.parametrize("hierarchy", ["node", 2])
@pytest.mark.parametrize("accum,checkpointing", [(1, False), (2, True)])
def test_hpz_trains_as_flat_stage_3_with_less_sent_between_nodes(ranks, hierarchy, accum,
                                                                                checkpointing):
    """4 ranks as 2 nodes of 2: losses and parameters within 1e-5 of flat stage 3's (the gradients are summed
    within a node first: Note [Two-level reduce-scatter]); no all-gather after the first forward crosses a node
    and the reduce-scatter sends 1/2 as much between them; the secondary shards hold 1/2 of the gathered units
    until the step, and nothing after it."""
    for r in ranks(4).run(cases.against_flat, ranks_per_node=2, hierarchy=hierarchy, accum=accum, steps=3,
                          activation_checkpointing=checkpointing):
        assert r["loss_diff"] <= 1e-5 and r["params_diff"] <= 1e-5, r
        assert r["size"] == 2 and r["remote"] == 2, r
        assert r["secondary_bytes"] == r["gathered_bytes"] // 2 and r["after_step"] == 0, r
        for (flat_sent, flat_inter), (hpz_sent, hpz_inter) in zip(r["flat"], r["hpz"]):
            assert abs(flat_inter - flat_sent * 2 / 3) <= 8, r  # 2 of the 3 other ranks are on the other node
            # per micro-step flat sends 3 units' worth between nodes (forward and backward all-gathers, the
            # reduce-scatter); hpZ the first forward's all-gather and 1/G of each reduce-scatter (G = 2)
            assert abs(hpz_inter - flat_inter * (1 + accum / 2) / (3 * accum)) <= 16, r


@pytest.mark.parametrize("in_place", [False, True])
def test_the_two_level_reduce_scatter_sums_as_the_flat_one_with_half_between_nodes(ranks, in_place):
    """Note [Two-level reduce-scatter]: this rank's chunk of the sum over all ranks (exact, integer-valued), with
    1/G of the flat form's bytes between nodes (G = 2)."""
    for r in ranks(4).run(cases.two_level_reduce_scatter, in_place=in_place):
        assert r["wrong"] == 0, r
        assert r["inter_node"][1] * 2 == r["inter_node"][0], r


PLUS = {"hierarchy": "node", "quantize_weights": "int8", "quantize_grads": "int8"}


@pytest.mark.parametrize("saved_with,resumed_with", [(PLUS, None), (None, PLUS), (PLUS, PLUS)],
                         ids=["plus-to-flat", "flat-to-plus", "plus-to-plus"])
def test_checkpoints_move_between_flat_and_zero_plus_plus(ranks, tmp_path, saved_with, resumed_with):
    """A checkpoint saved with hpZ, qwZ and qgZ resumes without them and the other way round (the secondary shards
    are not saved; the masters never held a rounded weight; qgZ's rounded gradients are stepped, never saved): the loaded masters and optimizer states are the saved
    ones, bit for bit, 4 ranks as 2 nodes of 2; with the same settings the losses go on as without the save."""
    saved = ranks(4).run(cases.checkpoint_case, case="save_and_continue", ranks_per_node=2, root=str(tmp_path),
                         stage=3, save_at=2, steps=4, zero=saved_with)
    resumed = ranks(4).run(cases.checkpoint_case, case="resume_and_continue", ranks_per_node=2,
                           path=saved[0]["path"], stage=3, steps=4, zero=resumed_with)
    for s, r in zip(saved, resumed):
        assert r["masters"] == s["masters"] and r["optim"] == s["optim"]
        if saved_with == resumed_with:
            assert r["losses"] == s["losses"], (r["losses"], s["losses"])
        else:
            assert max(abs(a - b) / abs(b) for a, b in zip(r["losses"], s["losses"])) <= 1e-2


def test_hpz_matches_ddp(ranks):
    """As every stage: within 1e-5 of DDP (tests/test_zero_parity.py), 4 ranks as 2 nodes of 2."""
    check(ranks(4).run(cases.parity, ranks_per_node=2, stage=3, model="gpt", steps=8, hierarchy="node"))


@pytest.mark.parametrize("ranks_per_node,config,message", [
    (2, {"stage": 2, "hierarchy": "node"}, "zero.hierarchy: hierarchical partitioning (hpZ) shards parameters"),
    (2, {"stage": 3, "hierarchy": 1}, "zero.hierarchy must be node or a number of ranks >= 2, got 1"),
    (2, {"stage": 3, "hierarchy": "rack"}, "zero.hierarchy must be node or a number of ranks >= 2, got 'rack'"),
    (2, {"stage": 3, "hierarchy": 2}, "zero.hierarchy: 2 must divide the world size 2 and be below it"),
    (4, {"stage": 3, "hierarchy": "node"}, "zero.hierarchy: node: all 2 ranks run on one node"),
    (1, {"stage": 3, "hierarchy": "node"}, "zero.hierarchy: one rank per node"),
])
def test_what_cannot_work_is_one_line_on_every_rank(ranks, ranks_per_node, config, message):
    for r in ranks(2).run(cases.refused, ranks_per_node=ranks_per_node, **config):
        assert r.startswith(message), r


@pytest.mark.parametrize("config", [0, 2])  # estimate_cases.CONFIGS: the GPT (persistent norms), the frozen MLP
def test_the_estimate_equals_what_the_runtime_counts_on_two_nodes(ranks, config):
    """``zerorun estimate``'s bytes sent per step, of them to other nodes (Note [Nodes of a group]), and the
    secondary shards' bytes (Note [Secondary shards]) equal zero/comm.py's count and ``SecondaryShards.nbytes``
    on 4 ranks as 2 nodes of 2, flat and with hierarchy node and 2, 1 and 2 micro-steps, and with qwZ's int8
    all-gathers (blocks of 64) flat and with hierarchy (before: the estimate had no bytes to other nodes, no
    secondary all-gathers and no secondary shards, and counted qwZ's all-gathers exact)."""
    from test_estimate import engine_layout
    from zerorun import estimate as est

    import estimate_cases

    layout = engine_layout(estimate_cases.CONFIGS[config], 3)
    fp32 = est.precision_of("fp32", None)
    pool = ranks(4)
    for hierarchy, accum, block in [(h, a, None) for h in (None, "node", 2) for a in (1, 2)] + [(None, 1, 64),
                                                                                               ("node", 2, 64)]:
        group = est.group_size(hierarchy, (2, 2))
        want = est.traffic(layout, 3, 4, fp32, accum, node_ranks=(2, 2), group=group, quantize_block=block)
        secondary = est.secondary_bytes(layout, 4, fp32.param_bytes, group)
        where = (config, hierarchy, accum, block, want, secondary)
        assert want.inter_node > 0 and (secondary > 0) == (hierarchy is not None), where
        for r in pool.run(cases.traffic, ranks_per_node=2, hierarchy=hierarchy, accum=accum, config=config,
                          quantize_block=block):
            assert all(abs(s - want.sent) <= 8 for s in r["sent"]), (where, r)
            assert all(abs(s - want.inter_node) <= 8 for s in r["inter_node"]), (where, r)
            assert r["secondary"] == [secondary] * len(r["secondary"]), (where, r)


@pytest.mark.parametrize("hostfile,hierarchy,message", [
    ("localhost slots=2\n", "node", "zero.hierarchy: node: all 2 ranks run on one node"),
    ("127.0.0.2 slots=1\n127.0.0.3 slots=1\n", "node", "zero.hierarchy: one rank per node"),
    ("127.0.0.2 slots=1\n127.0.0.3 slots=2\n", "node", "zero.hierarchy: node needs the same number of consecutive"),
    ("127.0.0.2 slots=2\n127.0.0.3 slots=2\n", "3", "zero.hierarchy: 3 must divide the world size 4"),
])
def test_train_refuses_a_hierarchy_its_hosts_cannot_take_before_anything_starts(tmp_path, hostfile, hierarchy,
                                                                                message):
    """What the ranks would refuse at their setup (after start-up and the model's construction) is the launcher's
    one line, with the hosts, in a dry run too: nothing is contacted, exit 2."""
    import os
    import subprocess
    import sys

    hosts = tmp_path / "hostfile"
    hosts.write_text(hostfile)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-m", "zerorun", "train", os.path.join(root, "recipes", "tiny.yaml"),
                          "-H", str(hosts), "--dry-run", "zero.stage=3", f"zero.hierarchy={hierarchy}"],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 2, (out.returncode, out.stdout[-2000:], out.stderr[-2000:])
    assert out.stderr.startswith(f"zerorun: error: {message}") and out.stderr.count("\n") == 1, out.stderr
    assert "(hosts: " in out.stderr and "torchrun" not in out.stdout
