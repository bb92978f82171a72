"""Models built in the ways construction code really builds tensors (tests/test_construction.py): each factory
is compared between normal construction and ``deferred_init`` + replay, bit for bit."""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn as nn


class DataForms(nn.Module):
    """Parameters and buffers whose values come from Python or numpy data, not from an aten op."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.p_scalar = nn.Parameter(torch.tensor(1.5))
        self.p_list = nn.Parameter(torch.tensor([1.0, 2.0, 3.0]))
        self.p_numpy = nn.Parameter(torch.from_numpy(np.arange(3, dtype=np.float32)))
        self.p_numpy64 = nn.Parameter(torch.from_numpy(np.linspace(0, 1, 4)).float())
        self.p_as_tensor = nn.Parameter(torch.as_tensor([[0.5, -0.5]]))
        self.p_asarray = nn.Parameter(torch.asarray(np.ones((2, 2), dtype=np.float32) * 3))
        self.p_new_tensor = nn.Parameter(self.lin.weight.new_tensor([4.0, 5.0]))
        self.p_explicit_cpu = nn.Parameter(torch.tensor([6.0, 7.0], device="cpu"))
        self.register_buffer("b_tensor", torch.tensor([7.0, 8.0]))
        self.register_buffer("b_int", torch.tensor([1, 2, 3]))
        self.register_buffer("b_bool", torch.tensor([True, False]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).sum() * self.p_scalar + self.p_list.sum() + self.p_numpy.sum()


class FactoryForms(nn.Module):
    """Tensor factories (full, linspace, arange, eye, ...) and arithmetic on them."""

    def __init__(self) -> None:
        super().__init__()
        self.p_full = nn.Parameter(torch.full((3,), 2.5))
        self.p_ones_mul = nn.Parameter(torch.ones(3) * math.log(1 / 0.07))
        self.p_linspace = nn.Parameter(torch.linspace(0, 1, 5))
        self.p_logspace = nn.Parameter(torch.logspace(0, 2, 3))
        self.p_eye = nn.Parameter(torch.eye(3))
        self.p_zeros_fill = nn.Parameter(torch.zeros(2, 2).fill_(0.25))
        self.p_empty_copy = nn.Parameter(torch.empty(3).copy_(torch.tensor([1.0, -1.0, 2.0])))
        self.p_window = nn.Parameter(torch.hann_window(4))
        self.p_randn = nn.Parameter(torch.randn(5) * 0.1 + 1)
        self.p_mixed = nn.Parameter(torch.ones(3) * torch.tensor([1.0, 2.0, 3.0]))  # meta x real data
        self.register_buffer("b_arange", torch.arange(4).float())
        self.register_buffer("b_tril", torch.tril_indices(3, 3))
        self.register_buffer("b_mask", torch.tril(torch.ones(4, 4)).view(1, 1, 4, 4))


class InPlaceAfter(nn.Module):
    """Layers whose values are rewritten after construction, whole or in part."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 4)
        self.b = nn.Linear(4, 4)
        self.c = nn.Linear(4, 3)
        self.emb = nn.Embedding(6, 4, padding_idx=1)
        constant = torch.tensor([0.5, 1.0, 1.5, 2.0])
        with torch.no_grad():
            self.a.weight.mul_(0.5)
            self.a.bias.copy_(constant)
            constant.add_(100.0)  # a later change of the real source must not leak into the recorded copy
            nn.init.orthogonal_(self.b.weight)
            nn.init.uniform_(self.b.bias, -0.1, 0.1)
            nn.init.kaiming_normal_(self.c.weight)
            self.c.weight[0] = torch.tensor([1.0, 2.0, 3.0, 4.0])  # a partial write from data
            self.c.weight.data[:, 1] = 7.0
            self.emb.weight.normal_(0, 0.02, generator=torch.Generator().manual_seed(5))
            self.emb.weight[self.emb.padding_idx].zero_()
        self.c.bias.data = torch.tensor([9.0, 8.0, 7.0])  # .data replaced by real data


def torch_layers() -> nn.Module:
    """torch's own layers with their own init schemes (xavier, orthogonal-free RNN uniform, norms,
    parametrizations computed from random weights)."""
    from torch.nn.utils import parametrizations

    return nn.ModuleDict({
        "mha": nn.MultiheadAttention(8, 2),
        "lstm": nn.LSTM(4, 6, num_layers=2),
        "gru": nn.GRU(4, 3),
        "conv": nn.Conv2d(3, 5, 3),
        "bn": nn.BatchNorm1d(5),
        "encoder": nn.TransformerEncoderLayer(8, 2, dim_feedforward=16),
        "weight_norm": parametrizations.weight_norm(nn.Linear(4, 4)),
        "spectral_norm": parametrizations.spectral_norm(nn.Linear(4, 4)),
        "bilinear": nn.Bilinear(3, 4, 2),
        "prelu": nn.PReLU(3),
    })


def hf_from_config(dtype=None) -> nn.Module:
    """A transformers model as users build it from a config (AutoModel), optionally in another dtype."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(_llama_config(), **({"dtype": dtype} if dtype else {}))


def data_forms() -> nn.Module:
    return DataForms()


def factory_forms() -> nn.Module:
    return FactoryForms()


def in_place_after() -> nn.Module:
    return InPlaceAfter()


def reads_values() -> nn.Module:
    """Construction that reads values made without random numbers (a drop-path schedule, a mask check)."""
    rates = torch.linspace(0, 0.2, 3)
    model = nn.Sequential(*[nn.Linear(3, 3) for _ in range(3)])
    for layer, rate in zip(model, rates):
        layer.rate = float(rate.item())
    mask = torch.tril(torch.ones(3, 3))
    if bool((mask.sum(0) > 0).all()):  # a data-dependent branch on a deterministic tensor
        model.register_buffer("mask", mask * torch.tensor(2.0))
    idx = torch.nonzero(torch.arange(6) % 2)  # a data-dependent shape
    model.register_buffer("odd", idx.flatten().float())
    return model


def reads_random_values() -> nn.Module:
    """Construction that reads values made from random numbers: no shadow, built normally."""
    model = nn.Linear(3, 3)
    model.scale = float(model.weight.detach().abs().max())
    return model


def trunc_normal() -> nn.Module:
    """``trunc_normal_`` samples by rejection in recent torch (a loop on the values): replayed or built normally."""
    model = nn.Linear(6, 6)
    nn.init.trunc_normal_(model.weight, std=0.02)
    return model


def hook_holds_mask() -> nn.Module:
    """A gradient hook that keeps a mask made during construction (the mask is not a parameter or buffer)."""
    model = nn.Linear(4, 4)
    mask = torch.ones(4, 4)
    mask[:2] = 0
    model.weight.register_hook(lambda g: g * mask)
    return model


def forward_hook_holds_tensor() -> nn.Module:
    """A module forward hook that keeps a tensor made during construction."""
    model = nn.Linear(4, 4)
    shift = torch.full((4,), 0.5)
    model.register_forward_hook(lambda module, args, out: out + shift)
    return model


def draws_real_random_numbers() -> nn.Module:
    first = nn.Linear(2, 2)
    noise = torch.rand(3, device="cpu")  # a real draw between recorded ops: a replay could not reproduce it
    model = nn.Sequential(first, nn.Linear(2, 2))
    model.register_buffer("noise", noise)
    return model


def _llama_config(**kw):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=97, max_position_embeddings=32, **kw)


class CausalLM(nn.Module):
    """A transformers causal LM built from a config, forward(batch of token ids (B, T)) -> mean loss."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=batch, labels=batch).loss


def hf_llama(tie_word_embeddings: bool = False) -> nn.Module:
    from transformers import LlamaForCausalLM

    return CausalLM(LlamaForCausalLM(_llama_config(tie_word_embeddings=tie_word_embeddings)))


def hf_gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=97, n_positions=32)
    return CausalLM(GPT2LMHeadModel(cfg))
