"""Deferred (meta-device) initialization: exact values, bounded memory, clear errors."""

import pytest
import torch
import torch.nn as nn

from parity_cases import _gpt_module as gpt_module
from zerorun.zero.deferred import deferred_init, is_deferred, materialize, replay


@pytest.mark.parametrize("factory,kwargs", [
    ("gpt", dict(vocab_size=97, n_layer=3, n_head=2, d_model=24, max_seq_len=20)),
    ("gpt", dict(vocab_size=97, n_layer=2, n_head=2, d_model=24, max_seq_len=20, tie_embeddings=False)),
    ("plain", {}),
])
def test_materialize_equals_normal_construction_bit_for_bit(factory, kwargs):
    build = gpt_module().build_model if factory == "gpt" else (
        lambda: nn.Sequential(nn.Linear(5, 7), nn.BatchNorm1d(7), nn.Embedding(11, 3, padding_idx=2)))
    torch.manual_seed(11)
    normal = build(**kwargs)
    after_normal = torch.rand(5)
    torch.manual_seed(11)
    model = deferred_init(build, **kwargs)
    assert is_deferred(model) and all(p.is_meta for p in model.parameters())
    materialize(model)
    assert torch.equal(torch.rand(5), after_normal)  # the generator ends where normal construction leaves it
    ref = normal.state_dict()
    got = model.state_dict()
    assert list(got) == list(ref)
    for k in ref:
        assert torch.equal(got[k], ref[k]), k
    if factory == "gpt" and kwargs.get("tie_embeddings", True):
        assert model.lm_head.weight is model.tok_emb.weight


def test_replay_holds_a_few_parameters_not_the_model():
    """The GPT initializes every weight twice (constructor, then its own init): the replay frees each first
    life at once, so its peak is a couple of the largest tensors, not the model (Note [Record and replay])."""
    torch.manual_seed(0)
    model = deferred_init(gpt_module().build_model, vocab_size=512, n_layer=8, n_head=4, d_model=128,
                          max_seq_len=64)
    sizes = [p.numel() * 4 for p in model.parameters()]
    peak = replay(model, lambda meta, value: None)
    assert peak <= 2 * max(sizes), (peak, max(sizes))
    assert peak < sum(sizes) / 8


def test_factory_drawing_real_random_numbers_is_built_normally():
    """A real draw between recorded ops cannot be replayed: the model is built normally, with a warning (it
    used to be refused; tests/test_construction.py checks the values)."""
    def factory():
        first = nn.Linear(2, 2)
        torch.rand(3, device="cpu")
        return nn.Sequential(first, nn.Linear(2, 2))

    with pytest.warns(UserWarning, match="built normally .*drew random numbers on real"):
        model = deferred_init(factory)
    assert not is_deferred(model) and not any(p.is_meta for p in model.parameters())
