"""ZeRO++'s quantized weights (qwZ, ``zero.quantize_weights: int8``; Note [Quantized weights] in
zerorun/zero/quantize.py): blockwise int8 all-gathers whose rounding only forward and backward see."""

import pytest
import torch

import quantize_cases as cases
from zerorun.zero.quantize import (WeightQuantizer, block_size, blocks, dequantize_rows, message_bytes,
                                   quantize_into)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("numel,block", [(1, 256), (255, 256), (256, 256), (1000, 7), (4099, 2048)])
def test_blockwise_quantization_rounds_within_half_a_step_of_each_block(numel, block, bits):
    """int8 (qwZ, qgZ) and int4 (qgZ, two values to a byte): each value back within half its block's step
    (``max|x| / 127`` or ``/ 7``), the values within the width, the message of the bytes the estimate counts."""
    x = torch.randn(numel, dtype=torch.float64).float() * torch.logspace(-3, 3, numel)
    x[numel // 2:numel // 2 + 3] = 0.0
    message = torch.empty(message_bytes([(numel, torch.float32)], block, bits), dtype=torch.uint8)
    quantize_into(message, x, block, bits)
    block = block_size(numel, block)  # at most the slice
    nb = blocks(numel, block)
    back = dequantize_rows(message.view(1, -1), numel, block, bits)[0]
    qmax = {8: 127, 4: 7}[bits]
    step = torch.nn.functional.pad(x, (0, nb * block - numel)).view(nb, block).abs().amax(1) / qmax
    half = step.repeat_interleave(block)[:numel] / 2
    assert torch.all((back - x).abs() <= half * (1 + 1e-6))
    levels = torch.round(back / step.clamp_min(1e-30).repeat_interleave(block)[:numel]).abs()
    assert torch.all(levels <= qmax)
    assert message.numel() == (nb * block if bits == 8 else (nb * block + 1) // 2) + 4 * nb


def test_a_block_of_zeros_and_integer_slices_come_back_exact():
    class Comm:  # one rank: the gather is the message itself
        world_size = 1

        def all_gather(self, output, input):
            output.copy_(input)
            return type("Done", (), {"wait": lambda self: True})()

    ints, zeros = torch.arange(-5, 6), torch.zeros(300)
    outs = [torch.empty_like(ints), torch.empty_like(zeros)]
    WeightQuantizer(64).all_gather(Comm(), outs, [ints, zeros]).wait()
    assert torch.equal(outs[0], ints) and torch.equal(outs[1], zeros)


@pytest.mark.parametrize("block", [64, 256])
def test_qwz_trains_close_to_exact_stage_3_and_sends_a_quarter(ranks, block):
    """2 ranks, tiny GPT, AdamW lr 1e-3, 4 steps: every rank's forward reads the same weights, each within half
    a quantization step of the exact engine's; the losses stay within 1% of the exact run's."""
    for r in ranks(2).run(cases.against_exact, block=block):
        assert r["same_on_every_rank"] and r["changed"], r
        assert r["rounding"] <= 0.5 * (1 + 1e-4), r
        assert max(r["loss_diff"]) <= 1e-2 and r["loss_diff"][0] > 0, r



@pytest.mark.parametrize("block", [64, 2048])
def test_the_parameter_gathers_send_int8_and_a_scale_per_block(ranks, block):
    for r in ranks(2).run(cases.gather_bytes, block=block):
        for exact, quantized in r["sent"]:
            assert exact - quantized == r["expected_saving"], r


def test_a_root_unit_without_parameters_gathers_nothing(ranks):
    """Units that hold every parameter (the root unit left empty, as the 55M GPT's zero.units [Block, Embedding]
    with its outer units leave it): the root's quantized gather is no collective, not an IndexError."""
    for r in ranks(2).run(cases.against_exact, block=256, steps=2, units=("Block", "Embedding"),
                          tie_embeddings=False):
        assert r["root_params"] == 0 and r["same_on_every_rank"] and max(r["loss_diff"]) <= 1e-2, r


def test_the_sharded_master_is_never_rounded(ranks):
    """lr 0: after steps with quantized gathers the state dict is the exact engine's, bit for bit."""
    for r in ranks(2).run(cases.against_exact, block=256, lr=0.0, steps=2):
        assert r["changed"] and r["states_equal"], r


def test_qwz_with_hpz_on_two_nodes(ranks):
    """4 ranks as 2 nodes of 2 with zero.hierarchy: node: the backward gathers the dequantized secondary shards;
    the same bound on the losses."""
    for r in ranks(4).run(cases.against_exact, block=256, ranks_per_node=2, hierarchy="node"):
        assert r["same_on_every_rank"] and max(r["loss_diff"]) <= 1e-2, r


class _OneRank:
    """A Comm of one rank: the gather is the message itself."""

    world_size = 1

    def all_gather(self, output, input):
        output.copy_(input)
        return type("Done", (), {"wait": lambda self: True})()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_weight_comes_back_nan_not_hidden(bad):
    """A diverged weight shows in the loss as it would exact: its block comes back NaN (before: a NaN became 0
    and its block's small values 0; an infinity made its block NaN by accident, or not at all)."""
    x = torch.full((300,), 0.02)
    x[5] = bad
    out = torch.empty(300)
    WeightQuantizer(256).all_gather(_OneRank(), [out], [x]).wait()
    assert out[:256].isnan().all() and out[256:].isfinite().all()


def test_a_block_larger_than_the_slice_is_the_slice():
    """``zero.quantize_block`` above a rank's slice sends no padding: 2088 float32 elements, block 65536, are one
    block of 2088 and one scale (before: 65,540 bytes, 7.8x the exact 8,352)."""
    assert message_bytes([(2088, torch.float32)], 65536) == 2088 + 4
    x = torch.linspace(-1, 1, 2088)
    out = torch.empty(2088)
    WeightQuantizer(65536).all_gather(_OneRank(), [out], [x]).wait()
    assert (out - x).abs().max() <= 1 / 127 / 2 * (1 + 1e-6)
