"""ZeRO++'s quantized gradients (qgZ, ``zero.quantize_grads: int8 | int4``; Note [Quantized gradients] in
zerorun/zero/quantized_grads.py): the gradients' reduce-scatter as an all-to-all of quantized blocks, summed in
fp32 on arrival, within the node first."""

import pytest

import quantized_grads_cases as cases
from zerorun.zero import ZeroConfig


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("per_node,hierarchy", [(4, None), (2, None), (2, 2)])
def test_the_quantized_reduce_scatter_is_its_emulation_and_sends_its_messages(ranks, bits, per_node, hierarchy):
    """4 ranks on one node (one level) or as 2 nodes of 2 (two levels, from the nodes or zero.hierarchy): each
    rank's output is, bit for bit, what the quantization primitives give for every rank's inputs; one level is
    within the sum of the other ranks' half steps of the exact sum; the bytes counted (all, to other nodes) are
    those of the quantized messages (the flat exact reduce-scatter would send 4 bytes per element)."""
    for r in ranks(4).run(cases.reduce_scatter, bits=bits, ranks_per_node=per_node, block=64, hierarchy=hierarchy):
        assert r["wrong"] == 0 and r["sent"] == r["expected"], r
        assert r["levels"] == (None if per_node == 4 else 2), r
        assert r["over_bound"] <= 1.0, r


def test_the_node_decides_the_levels(ranks):
    """Quantized gradients go within the node first where there are several nodes of several ranks; on one
    node, one level; zero.hierarchy's groups always give two levels; nothing set: the flat exact path."""
    kinds = ranks(4).run(cases.grad_path_kinds)[0]
    assert kinds == {"2/None/None": None, "2/None/2": "TwoLevelReduceScatter",
                     "2/int8/None": "TwoLevelReduceScatter", "2/int8/2": "TwoLevelReduceScatter",
                     "4/None/None": None, "4/None/2": "TwoLevelReduceScatter",
                     "4/int8/None": "QuantizedReduceScatter", "4/int8/2": "TwoLevelReduceScatter"}, kinds


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("optimizer", ["AdamW", "SGD"])
def test_qgz_trains_within_a_bound_of_ddp(ranks, stage, optimizer):
    """2 ranks, tiny GPT, 8 steps, int8: every step's loss and gradient norm within 1e-2 relative of DDP's (exact
    fp32 is within 1e-5: the bound is the quantization's) and some not equal (the gradients did travel
    quantized); the parameters' distance from DDP's within 5% of how far DDP moved them under SGD (lr 1e-2), 30%
    under AdamW (lr 1e-3: its per-element step is about lr whatever the gradient's size, so an element whose small
    gradient rounds to zero in a block of larger ones moves by 0 instead of lr; measured 0.15-0.18)."""
    for r in ranks(2).run(cases.against_ddp, stage=stage, quantize_grads="int8", optimizer=optimizer, steps=8):
        assert max(r["loss_diff"]) <= 1e-2 and max(r["norm_diff"]) <= 1e-2 and max(r["norm_diff"]) > 1e-5, r
        assert r["params_over_update"] <= (5e-2 if optimizer == "SGD" else 0.3), r


def test_qgz_int4_and_two_nodes_with_everything_else(ranks):
    """4 ranks as 2 nodes of 2, stage 3 with hpZ, int4 gradients, 2 micro-steps and clipping, SGD: within 5e-2 of
    DDP per step, the parameters within 20% of DDP's update (int4 keeps 15 levels a block)."""
    for r in ranks(4).run(cases.against_ddp, ranks_per_node=2, stage=3, steps=6, accum=2, grad_clip=0.5,
                          hierarchy="node", quantize_grads="int4", optimizer="SGD"):
        assert max(r["loss_diff"]) <= 5e-2 and max(r["norm_diff"]) <= 5e-2 and max(r["norm_diff"]) > 1e-5, r
        assert r["params_over_update"] <= 0.2, r


@pytest.mark.parametrize("kwargs,message", [
    ({"stage": 0, "quantize_grads": "int8"}, "zero.quantize_grads quantizes the gradients' reduce-scatter of "
                                            "stages 1-3; stage 0 all-reduces"),
    ({"stage": 2, "quantize_grads": "int2"}, "zero.quantize_grads must be int8, int4 or unset, got 'int2'")])
def test_what_qgz_cannot_do_is_one_line(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ZeroConfig(**kwargs)


@pytest.mark.parametrize("stage,per_node", [(2, 2), (3, 2), (3, 4)])
def test_the_estimate_equals_what_the_runtime_counts(ranks, stage, per_node):
    """``zerorun estimate``'s bytes per step and of them to other nodes equal zero/comm.py's count with quantized
    gradients (blocks of 64), int8 and int4, 1 and 2 micro-steps, on 4 ranks as 2 nodes of 2 (two levels by
    node; at stage 3 with zero.hierarchy too) and as one node (one level)."""
    from test_estimate import engine_layout
    from zerorun import estimate as est

    import estimate_cases
    import hierarchy_cases

    layout = engine_layout(estimate_cases.CONFIGS[0], stage)
    fp32, nodes = est.precision_of("fp32", None), (2, 2) if per_node == 2 else (4,)
    pool = ranks(4)
    hierarchies = (None, "node") if stage == 3 and per_node == 2 else (None,)
    for hierarchy, accum, bits in [(h, a, b) for h in hierarchies for a in (1, 2) for b in ("int8", "int4")]:
        group = est.group_size(hierarchy, nodes)
        grad_group = est.gradient_group(hierarchy, True, nodes)
        want = est.traffic(layout, stage, 4, fp32, accum, node_ranks=nodes, group=group, grad_group=grad_group,
                           grad_quantize=({"int8": 8, "int4": 4}[bits], 64))
        where = (stage, per_node, hierarchy, accum, bits, want)
        assert (want.inter_node > 0) == (per_node == 2), where
        for r in pool.run(hierarchy_cases.traffic, ranks_per_node=per_node, hierarchy=hierarchy, accum=accum,
                          config=0, stage=stage, quantize_grads=bits, grad_block=64):
            assert all(abs(s - want.sent) <= 8 for s in r["sent"]), (where, r)
            assert all(abs(s - want.inter_node) <= 8 for s in r["inter_node"]), (where, r)


@pytest.mark.parametrize("per_node", [4, 2])
def test_float64_gradients_stay_exact(ranks, per_node):
    """Float64 buckets (Note [Wide parameters]) are reduce-scattered exactly under zero.quantize_grads, in one or
    two levels: values beyond fp32's range come back as their sum, not NaN (before: quantized through fp32, NaN),
    and they send their 8 bytes per element."""
    for r in ranks(4).run(cases.wide, ranks_per_node=per_node):
        assert r["equal"] and r["dtype"] == "torch.float64", r
        assert r["sent"] == 3 / 4 * 40 * 8, r  # flat (N-1)/N of 40 elements; two levels 1/2 of them + 1/2 of 1/2


def test_the_estimate_counts_float64_buckets_exact():
    """``zerorun estimate`` counts float64 buckets exact under zero.quantize_grads, as the runtime sends them
    (before: as quantized messages), and fp32 ones quantized."""
    import torch

    from test_estimate import engine_layout
    from zerorun import estimate as est

    import estimate_cases

    fp32 = est.precision_of("fp32", None)
    layout = engine_layout(estimate_cases.CONFIGS[2], 2)
    with torch.device("meta"):
        wide = estimate_cases.build("mlp", {"frozen": True}).double()
    wide_layout = est.layout_of(wide, bucket_mb=0.0002)
    for lay, same in ((wide_layout, True), (layout, False)):
        exact = est.traffic(lay, 2, 4, fp32)
        quantized = est.traffic(lay, 2, 4, fp32, grad_quantize=(8, 64))
        assert (exact == quantized) == same, (exact, quantized)


def test_the_estimates_stages_below_3_ignore_zero_hierarchy(tmp_path, capsys, monkeypatch):
    """``zerorun estimate`` of a stage-3 recipe with ``zero.hierarchy: node`` on two hosts: its stage 1-2 rows count
    the gradients' reduce-scatter flat, as those stages run it (the runtime refuses zero.hierarchy below stage 3;
    before: two levels, a third fewer bytes between nodes), and in two levels by node with quantized gradients."""
    import json
    import os

    from zerorun import cli

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    (tmp_path / "hosts").write_text("127.0.0.2 slots=2\n127.0.0.3 slots=2\n")

    def rows(*overrides):  # the CLI in this process (the model is built on the meta device)
        monkeypatch.setattr("sys.argv", ["zerorun", "estimate", os.path.join(root, "recipes/tiny.yaml"), "-H",
                                         str(tmp_path / "hosts"), "--host-memory", "64GiB", "--gpu-memory", "80GiB",
                                         "--json", "zero.stage=3", *overrides])
        cli.main()
        return {r["label"]: r["comm_bytes_inter_node"] for r in json.loads(capsys.readouterr().out)["stages"]}

    flat, hpz = rows(), rows("zero.hierarchy=node")
    assert [hpz[s] for s in "012"] == [flat[s] for s in "012"] and hpz["3"] < flat["3"], (flat, hpz)
    qgz, both = rows("zero.quantize_grads=int8"), rows("zero.quantize_grads=int8", "zero.hierarchy=node")
    assert [both[s] for s in "12"] == [qgz[s] for s in "12"] and qgz["2"] < flat["2"], (qgz, both)
