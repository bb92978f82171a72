"""Activations and the transient working set per rank (Note [What is approximate] in ``estimate/__init__.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from zerorun.estimate.layout import Layout
from zerorun.estimate.states import _pad, _stage_buffers
from zerorun.estimate.policies import Precision


#: Full bucket gradients held at once at stages 2-3 (``ZeroEngine.MAX_INFLIGHT + 1``, Note [Gradient buffer pool]
#: in zero/engine.py): all of them may be in flight.
INFLIGHT_BUCKETS = 2 + 1


# ------------------------------------------------------------------------------------------ activations
def activation_bytes(shape: dict, *, micro_batch: int, seq_len: int | None = None, element_bytes: int = 4,
                     dropout: float | None = None) -> dict[str, int]:
    """Activation memory of one micro-batch of a GPT-style decoder (Korthikanti et al. 2022, §4).

    The paper's per-layer count, ``s·b·h·(34 + 5·a·s/h)`` bytes (16-bit activations, 1-byte dropout masks), is
    generalized to ``e`` bytes per element and ``d`` = 1 byte per dropout mask (0 without dropout):
    attention ``s·b·h·(5e + d) + a·s²·b·(e + [dropout](d + e))``, MLP ``s·b·h·(9e + d)``, two LayerNorms
    ``2·s·b·h·e``. Output layer (§4.3): final LayerNorm and LM-head inputs ``2·s·b·h·e``, logits and fp32
    log-softmax ``s·b·V·(e + 4)``; embedding dropout mask ``s·b·h·d``. Full activation checkpointing (one
    checkpoint per layer, §4.4) keeps each layer's input, ``s·b·h·e`` per layer, and recomputes one layer at a
    time.

    Args:
        shape: ``{"n_layer", "d_model", "n_head", "seq_len", "vocab_size"}`` (and optionally ``dropout``, and
            ``fused_attention``, which :func:`estimate` reads: the scores are not kept).
        micro_batch: samples per micro-batch ``b``; seq_len: tokens ``s`` (default ``shape["seq_len"]``).

    Returns:
        Bytes: ``per_layer`` and ``attention_scores`` (the ``a·s²·b`` part of it, which fused attention kernels
        such as ``F.scaled_dot_product_attention``'s flash kernel do not store), ``output``, ``total`` (no
        checkpointing), ``checkpointed``, and ``total_fused`` / ``checkpointed_fused`` without the scores.

    Raises:
        KeyError: ``shape`` lacks a key.
    """
    L, h, a, V = (int(shape[k]) for k in ("n_layer", "d_model", "n_head", "vocab_size"))
    s, b, e = int(seq_len or shape["seq_len"]), micro_batch, element_bytes
    drop = float(dropout if dropout is not None else shape.get("dropout", 0.0)) > 0
    d = 1 if drop else 0
    sbh = s * b * h
    scores = a * s * s * b * (e + (d + e if drop else 0))
    per_layer = sbh * (16 * e + 2 * d) + scores
    output = 2 * sbh * e + s * b * V * (e + 4) + sbh * d
    out = {"per_layer": per_layer, "attention_scores": scores, "output": output,
           "total": L * per_layer + output, "checkpointed": L * sbh * e + per_layer + output}
    out["total_fused"] = out["total"] - L * scores
    out["checkpointed_fused"] = out["checkpointed"] - scores
    return out



@dataclass(frozen=True)
class WorkingSet:
    """Transient bytes per rank above the model states at rest (Note [Peak]).

    Attributes:
        gathered: stage 3: the gathered parameters (the root unit, the outer units but embeddings, the largest
            listed unit and, with prefetch, the next largest, or with ``prefetch_bytes`` at most that many bytes
            of the other listed units), present while activations are (Note [Outer
            units] in zero/stage3_outer.py: an embedding that runs before the first listed unit is freed then;
            the first step, which holds no optimizer states yet, gathers every outer unit with the root).
        backward: gradient buckets in flight (stages 2-3: ``INFLIGHT_BUCKETS`` of the largest) plus, on gloo,
            the receive buffer of each pending reduce-scatter (Note [Reduce-scatter on gloo] in zero/comm.py;
            stage 1: every bucket, reduced all at once at the end of backward; stages 2-3: up to
            ``INFLIGHT_BUCKETS``).
    """

    gathered: int
    backward: int

    @property
    def total(self) -> int:
        return self.gathered + self.backward


def working_set(layout: Layout, stage: int, world_size: int, precision: Precision, *,
                bucket_mb: float = 25.0, prefetch: bool = True, gloo: bool = False,
                prefetch_bytes: int | None = None) -> WorkingSet:
    """The :class:`WorkingSet` of ``stage`` on ``world_size`` ranks (Note [What is approximate]); ``gloo``: the
    collectives run on gloo (CPU), where each pending reduce-scatter holds a receive buffer of its input's size,
    half of it on 2 ranks (Note [Reduce-scatter on gloo] in zero/comm.py; gloo's own reduce-scatter held a
    staging copy of the same size: 10 pending reduce-scatters of 19 MiB held 197 MiB; all-gathers 35 MiB;
    all-reduce nothing).
    Under ``zero.reduce_dtype: fp32`` with 2-byte gradients, stage 0 keeps each bucket's reduced fp32 copy until
    the step, and stage 1 reduces fp32 copies of its buckets, bounded as stage 2 is, keeping the fp32 slices."""
    N = world_size
    bufs = _stage_buffers(layout, stage)[0]
    wide = precision.reduce_bytes > precision.grad_bytes
    if stage == 0 or world_size == 1:
        return WorkingSet(0, sum(_pad(n, N) for n in bufs) * precision.reduce_bytes if wide and stage == 0 else 0)
    if layout.exact:
        largest = sorted((_pad(n, N) for n in bufs), reverse=True)
    else:  # one buffer of Ψ: the engine would cut it into buckets of bucket_mb
        largest = [min(_pad(bufs[0], N), int(bucket_mb * 2**20) // precision.param_bytes)] * INFLIGHT_BUCKETS
    received = 1 / N if N == 2 else 1  # of each reduce-scatter's input: 2 ranks receive the other's chunk only
    if stage == 1 and not wide:  # the full gradients are model states
        staged = (sum(_pad(n, N) for n in bufs) if layout.exact else _pad(bufs[0], N)) if gloo else 0
        backward = int(staged * received) * precision.grad_bytes
    else:
        held = sum(largest[:INFLIGHT_BUCKETS])
        staged = int(sum(largest[:INFLIGHT_BUCKETS]) * received) if gloo else 0
        kept = sum(_pad(n, N) // N for n in bufs) if stage == 1 else 0
        backward = (held + staged + kept) * precision.reduce_bytes
    if stage < 3:
        return WorkingSet(0, backward)
    if not layout.exact:
        return WorkingSet(sum(u.numel for u in layout.units) * (2 if prefetch else 1) * precision.param_bytes,
                          backward)
    def padded(u) -> int:
        return sum(_pad(n, N) for n in u.trainable + u.frozen)

    sizes = sorted((padded(u) for u in layout.listed_units),
                   reverse=True)
    root = sum(padded(u) for u in layout.units if u.name == "<root>")
    outer = sum(padded(u) for u in layout.units if u.outer and not u.embedding)  # Note [Outer units]
    pb = precision.param_bytes
    if prefetch and prefetch_bytes is not None:
        return WorkingSet((root + outer + sum(sizes[:1])) * pb + _ahead(sizes[1:], prefetch_bytes // pb) * pb,
                          backward)
    return WorkingSet((root + outer + sum(sizes[:2 if prefetch else 1])) * pb, backward)


def _ahead(sizes: list[int], limit: int) -> int:
    """The most elements of whole units (of ``sizes`` elements each) that ZeroConfig.prefetch_bytes lets stage 3
    gather ahead (``limit`` elements; zero/units.py ``units_ahead``): no more than ``limit``, nor than the ``k``
    largest units where ``k`` is the most units that fit at all (the ``k`` smallest)."""
    k, total = 0, 0
    for n in sorted(sizes):
        if total + n > limit:
            break
        k, total = k + 1, total + n
    return min(limit, sum(sorted(sizes, reverse=True)[:k]))
