"""`zerorun estimate` counts the fp32 gradient accumulation buffer (``zero.grad_accum_dtype``; Note [Gradient
accumulation buffer] in zerorun/estimate/states.py): stages 0-1 Ψ x 4 bytes, stages 2-3 Ψ/N x 4 bytes."""

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
    assert ms.grad_accum == 4 * elements and plain.grad_accum == 0
    assert (ms.params, ms.grads, ms.optimizer) == (plain.params, plain.grads, plain.optimizer)
    assert ms.total == plain.total + 4 * elements
    # gradients that are already 4 bytes need no second buffer: fp32, or stage 2-3 slices reduced in fp32
    assert est.model_states(LAYOUT, stage, N, est.precision_of("fp32"), adam, grad_accum_bytes=4).grad_accum == 0
    wide = est.model_states(LAYOUT, stage, N, est.precision_of("bf16", "fp32"), adam, grad_accum_bytes=4)
    assert wide.grad_accum == (4 * elements if stage < 2 else 0)


def _from_recipe(monkeypatch, overrides, grad_accum_dtype):
    """``from_arguments`` on the bundled recipe, whose ``zero`` carries ``grad_accum_dtype`` (a field another
    change adds to the recipe; here set on the loaded object)."""
    import zerorun.recipe

    load = zerorun.recipe.load_recipe

    def with_field(path, overrides_):
        r = load(path, overrides_)
        object.__setattr__(r.zero, "grad_accum_dtype", grad_accum_dtype)
        return r

    monkeypatch.setattr(zerorun.recipe, "load_recipe", with_field)
    return est.from_arguments(recipe=os.path.join(ROOT, "recipes/gpt-stdlib.yaml"), overrides=overrides,
                              hostfile=None, params=None, largest_layer=None, nodes=1, procs_per_node=2,
                              precision=None, optimizer=None, device_memory="80GiB", cpu_memory="1TiB",
                              bandwidth="100Gbps", micro_batch=None, offload="none")


def test_a_recipe_with_bf16_accumulation_counts_the_buffer_and_says_so(monkeypatch):
    accum = _from_recipe(monkeypatch, ["precision=bf16", "train.grad_accum_steps=4"], None)
    bf16 = _from_recipe(monkeypatch, ["precision=bf16", "train.grad_accum_steps=4"], "bf16")
    for a, b in zip(accum.rows, bf16.rows):
        assert b.grad_accum == 0 and a.grad_accum == 2 * a.grads > 0  # fp32 next to bf16: twice the bytes
        assert a.model_states == b.model_states + a.grad_accum and a.device_total == b.device_total + a.grad_accum
    assert any("gradients accumulate in fp32" in n and "Ψ/N x 4 bytes" in n for n in accum.notes), accum.notes
    assert not any("accumulate" in n for n in bf16.notes)
    assert accum.to_json()["setup"]["grad_accum_dtype"] is None and bf16.setup["grad_accum_dtype"] == "bf16"
