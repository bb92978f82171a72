"""A small GPT decoder, written as an ordinary zerorun user model module.

zerorun loads this file exactly as it loads a user's module: ``model.module`` in a recipe names the file
and ``model.factory`` the callable (here :func:`build_model`). Nothing in zerorun special-cases it.

Shapes: ``B`` batch (micro-batch size), ``T`` sequence length, ``C`` model width (``d_model``),
``H`` heads, ``V`` vocabulary size. Tokens are ``torch.int64``; activations use the parameters' dtype.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention through ``F.scaled_dot_product_attention``.

    Input and output: ``(B, T, C)``.
    """

    def __init__(self, d_model: int, n_head: int, dropout: float = 0.0) -> None:
        super().__init__()
        if d_model % n_head:
            raise ValueError(f"d_model ({d_model}) must be divisible by n_head ({n_head})")
        self.n_head = n_head
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        # (B, T, C) -> (B, H, T, C/H)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.proj(y.transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: ``x + attn(ln(x))`` then ``x + mlp(ln(x))``. ``(B, T, C) -> (B, T, C)``."""

    def __init__(self, d_model: int, n_head: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head, dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model), nn.Dropout(dropout)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """GPT decoder: token + learned position embeddings, ``n_layer`` :class:`Block` s, final LayerNorm, LM head.

    ``forward(batch)`` takes ``batch`` of shape ``(B, T + 1)`` int64 (inputs are ``batch[:, :-1]``, targets
    ``batch[:, 1:]``) and returns a dict with ``loss`` (scalar, mean cross-entropy in nats per token) and
    ``logits`` ``(B, T, V)``. With ``tie_embeddings`` the LM head shares the token embedding's weight
    (Press & Wolf 2017).
    """

    def __init__(
        self,
        vocab_size: int = 256,
        n_layer: int = 4,
        n_head: int = 4,
        d_model: int = 128,
        max_seq_len: int = 128,
        dropout: float = 0.0,
        tie_embeddings: bool = True,
    ) -> None:
        super().__init__()
        self.max_seq_len = max_seq_len
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(max_seq_len, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d_model, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        if tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        # Transformer shape, read by zerorun's estimator and telemetry (FLOP/s, activation memory).
        # fused_attention: F.scaled_dot_product_attention keeps no (B, H, T, T) attention scores.
        self.shape = {"n_layer": n_layer, "d_model": d_model, "n_head": n_head, "seq_len": max_seq_len,
                      "vocab_size": vocab_size, "dropout": dropout, "fused_attention": True}
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
                # GPT-2's scaled init of residual projections.
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, batch: torch.Tensor) -> dict[str, torch.Tensor]:
        idx, targets = batch[:, :-1], batch[:, 1:]
        T = idx.shape[1]
        if T > self.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds max_seq_len {self.max_seq_len}")
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        return {"loss": loss, "logits": logits}


def build_model(**kwargs) -> GPT:
    """Factory named by recipes: ``build_model(vocab_size=256, n_layer=4, ...)`` -> :class:`GPT`."""
    return GPT(**kwargs)
