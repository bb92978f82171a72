"""`zerorun estimate` counts the fp32 gradient accumulation buffer (``zero.grad_accum_dtype``; Note [Gradient
accumulation buffer] in zerorun/estimate/states.py): stages 0-1 a buffer of Ψ x 4 bytes beside the gradients,
stages 2-3 the gradient partition itself kept in fp32, Ψ/N x 4 bytes (what ZeroEngine.memory_bytes() reports:
tests/test_estimate.py compares the two)."""

import os

import pytest

from zerorun import estimate as est

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYOUT = est.layout_of_count(1_000_001)  # one buffer, padded to 1_000_002 at N = 2
N = 2


@pytest.mark.parametrize("precision,steps,dtype,expected", [
    ("bf16", 4, None, 4), ("fp16", 2, None, 4),    # unset: fp32 under 2-byte precision with accumulation
    ("bf16", 1, None, 2), ("fp32", 4, None, 4),    # no accumulation, or fp32 gradients: their own dtype
    ("bf16", 1, "fp32", 4), ("bf16", 8, "bf16", 2), ("fp32", 4, "fp16", 2),
])
def test_the_accumulation_dtype_rule(precision, steps, dtype, expected):
    assert est.grad_accum_bytes(est.precision_of(precision), steps, dtype) == expected


@pytest.mark.parametrize("stage,elements", [(0, 1_000_002), (1, 1_000_002), (2, 500_001), (3, 500_001)])
def test_model_states_count_the_buffer_per_stage(stage, elements):
    bf16, adam = est.precision_of("bf16"), est.optimizer_model("adam")
    plain = est.model_states(LAYOUT, stage, N, bf16, adam)
    ms = est.model_states(LAYOUT, stage, N, bf16, adam, grad_accum_bytes=4)
    if stage < 2:  # a separate fp32 buffer beside the bf16 gradients
        assert ms.grad_accum == 4 * elements and ms.grads == plain.grads == 2 * elements
    else:  # the partition itself in fp32
        assert ms.grad_accum == 0 and ms.grads == 4 * elements and plain.grads == 2 * elements
    assert plain.grad_accum == 0 and (ms.params, ms.optimizer) == (plain.params, plain.optimizer)
    assert ms.total == plain.total + (4 if stage < 2 else 2) * elements
    # gradients that are already 4 bytes need nothing more: fp32, or stage 2-3 slices reduced in fp32
    fp32 = est.model_states(LAYOUT, stage, N, est.precision_of("fp32"), adam, grad_accum_bytes=4)
    assert fp32.total == est.model_states(LAYOUT, stage, N, est.precision_of("fp32"), adam).total
    wide = est.model_states(LAYOUT, stage, N, est.precision_of("bf16", "fp32"), adam, grad_accum_bytes=4)
    assert wide.grad_accum == (4 * elements if stage < 2 else 0)


def _from_recipe(overrides):
    return est.from_arguments(recipe=os.path.join(ROOT, "recipes/gpt-stdlib.yaml"), overrides=overrides,
                              hostfile=None, params=None, largest_layer=None, nodes=1, procs_per_node=2,
                              precision=None, optimizer=None, device_memory="80GiB", cpu_memory="1TiB",
                              bandwidth="100Gbps", micro_batch=None, offload="none")


def test_a_recipe_with_bf16_accumulation_counts_the_buffer_and_says_so():
    common = ["precision=bf16", "train.grad_accum_steps=4"]
    accum, bf16 = _from_recipe(common), _from_recipe(common + ["zero.grad_accum_dtype=bf16"])
    for a, b in zip(accum.rows, bf16.rows):
        assert b.grad_accum == 0
        if a.stage < 2:
            assert a.grad_accum == 2 * a.grads > 0  # fp32 next to bf16: twice the bytes
        else:
            assert a.grad_accum == 0 and a.grads == 2 * b.grads > 0  # the partition in fp32
        extra = a.model_states - b.model_states
        assert extra == (a.grad_accum if a.stage < 2 else b.grads) and a.device_total == b.device_total + extra
    assert any("gradients accumulate in fp32" in n and "Ψ/N x 4 bytes" in n for n in accum.notes), accum.notes
    assert not any("accumulate" in n for n in bf16.notes)
    assert accum.to_json()["setup"]["grad_accum_dtype"] is None and bf16.setup["grad_accum_dtype"] == "bf16"


@pytest.mark.parametrize("width", [80, 100, 120, 160])
def test_the_table_never_cuts_a_number(width):
    """zerorun estimate at 80-160 columns: every stage's total and fit shown whole (rich's table cut them to
    '0.…' at 80 and 100 columns: review); lower-priority columns go first (Note [Fitting the width])."""
    import io

    from rich.console import Console

    r = _from_recipe(["precision=bf16", "train.grad_accum_steps=4"])
    out = io.StringIO()
    est.render(r, Console(file=out, width=width, color_system=None))
    text = out.getvalue()
    assert "…" not in text and max(len(line) for line in text.splitlines()) <= width, text
    size = 2**30 if max(row.device_total for row in r.rows) >= 2**30 else 2**20
    for row in r.rows:
        total = f"{row.device_total / size:.3g}"
        line = next(ln for ln in text.splitlines() if ln.startswith(row.label.replace(" + offload ", "+") + " "))
        assert total in line.split() and "%" in line, (width, line)
