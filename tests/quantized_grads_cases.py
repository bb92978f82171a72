"""Rank-side cases for tests/test_quantized_grads.py (ZeRO++'s qgZ, Note [Quantized gradients] in
zerorun/zero/quantized_grads.py)."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from hierarchy_cases import on_nodes
from zerorun.zero.comm import Comm
from zerorun.zero.hierarchy import gradient_path
from zerorun.zero.quantize import BITS, dequantize_rows, message_bytes, quantize_rows


def _one_level(inputs: torch.Tensor, owner: int, k: int, block: int, bits: int) -> torch.Tensor:
    """What rank ``owner`` of a quantized reduce-scatter over the rows of ``inputs`` (``[P, P * k]``, one row per
    rank) ends with: every other row's chunk ``owner`` quantized and back, summed in fp32, plus its own exact."""
    chunks = inputs[:, owner * k:(owner + 1) * k]
    others = torch.cat([chunks[:owner], chunks[owner + 1:]])
    return dequantize_rows(quantize_rows(others, block, bits), k, block, bits).sum(0) + chunks[owner]


def _emulated(every: torch.Tensor, rank: int, size: int | None, k: int, block: int, bits: int) -> torch.Tensor:
    """This rank's output of the quantized reduce-scatter of every rank's input (``every``, ``[N, N * k]``), made
    from the quantization primitives alone: one level, or two over groups of ``size`` (Note [Two-level
    reduce-scatter]: reordered as ``[G, M]``, within the group, then across groups)."""
    n = every.shape[0]
    if not size:
        return _one_level(every, rank, k, block, bits)
    m, place, group = n // size, rank % size, rank // size
    reordered = every.view(n, m, size, k).transpose(1, 2).reshape(n, -1)
    middles = torch.stack([_one_level(reordered[j * size:(j + 1) * size], place, m * k, block, bits)
                           for j in range(m)])  # the inner sums of this rank's place in every group
    return _one_level(middles, group, k, block, bits)


def reduce_scatter(bits: int, ranks_per_node: int, block: int, hierarchy=None) -> dict:
    """Comm.reduce_scatter with ``zero.quantize_grads`` on this rank's node, against its emulation: gradients of
    magnitudes 1e-3..1e3 (a chunk of zeros among them) of 1, 7 and 1000 elements per rank; the largest error
    against the exact sum over its bound (the sum of the half steps of every message summed, one level), the
    bytes sent and sent to other nodes against those the messages hold."""
    n, r = dist.get_world_size(), dist.get_rank()
    with on_nodes(ranks_per_node):
        comm = Comm()
        comm.grad_path = path = gradient_path(comm, hierarchy, {8: "int8", 4: "int4"}[bits], block)
        size = getattr(path, "inner_comm", None) and path.inner_comm.world_size
        g = torch.Generator().manual_seed(r)
        wrong, over, expected_bytes = 0, 0.0, [0, 0]
        for k in (1, 7, 1000):
            x = torch.randn(n * k, generator=g) * torch.logspace(-3, 3, n * k)
            x[: k // 2] = 0.0
            parts = [torch.empty(n * k) for _ in range(n)]
            dist.all_gather(parts, x)
            every = torch.stack(parts)
            out = torch.empty(k)
            comm.wait([comm.reduce_scatter(out, x)])
            wrong += int(not torch.equal(out, _emulated(every, r, size, k, block, bits)))
            if not size:
                others = torch.cat([every[:r], every[r + 1:]])[:, r * k:(r + 1) * k]
                scales = quantize_rows(others, block, bits)[:, -4 * -(-k // min(block, k)):]
                half = scales.reshape(-1).clone().view(torch.float32).view(n - 1, -1) / 2
                bound = half.repeat_interleave(min(block, k), dim=1)[:, :k].sum(0)
                err = (out - every.sum(0)[r * k:(r + 1) * k]).abs()
                over = max(over, float((err / (bound * (1 + 1e-5) + 1e-30)).max()))
            expected_bytes = _add_bytes(expected_bytes, n, size, k, block, bits, ranks_per_node)
        sent = [sum(c.bytes_sent for c in [comm] + path.comms),
                sum(c.bytes_sent_inter_node for c in [comm] + path.comms)]
        return {"wrong": wrong, "over_bound": over, "sent": sent, "expected": expected_bytes, "levels": size}


def _add_bytes(total: list, n: int, size: int | None, k: int, block: int, bits: int, per_node: int) -> list:
    """``total`` plus the bytes (all, to other nodes) of one quantized reduce-scatter of ``n * k`` elements."""
    msg = lambda numel: message_bytes([(numel, torch.float32)], block, bits)  # noqa: E731
    if not size:
        sent = (n - 1) * msg(k)
        return [total[0] + sent, total[1] + sent * (n - per_node) // (n - 1)]
    m = n // size
    outer = (m - 1) * msg(k)  # groups are nodes here: the outer level crosses them all
    return [total[0] + (size - 1) * msg(m * k) + outer, total[1] + outer]


def grad_path_kinds() -> dict:
    """Which gradient path the engine's settings give on 4 ranks as 2 nodes of 2 and as 1 node."""
    out = {}
    for per_node in (2, 4):
        with on_nodes(per_node):
            for q in (None, "int8"):
                for h in (None, 2):
                    path = gradient_path(Comm(), h, q, 256)
                    out[f"{per_node}/{q}/{h}"] = type(path).__name__ if path is not None else None
    return out


def against_ddp(stage: int, quantize_grads: str, optimizer: str, steps: int, ranks_per_node: int = 0,
                accum: int = 1, **config) -> dict:
    """DDP and the engine with ``quantize_grads`` trained side by side on copies of the tiny GPT: per step the
    relative difference of the loss and of the gradient norm, and at the end the parameters' distance over the
    distance DDP's moved them (whole model, L2: a bias's few small gradients may round to zero in a block of
    larger ones, so per-tensor figures would say nothing of training)."""
    import copy

    from torch.nn.parallel import DistributedDataParallel as DDP

    import parity_cases
    from zerorun.zero import ZeroConfig, initialize

    rank, n = dist.get_rank(), dist.get_world_size()
    with on_nodes(ranks_per_node or n):
        model = parity_cases._build("gpt", 0)
        start = [p.detach().clone() for p in model.parameters()]
        kwargs = {"lr": 1e-3} if optimizer == "AdamW" else {"lr": 1e-2}
        ddp = DDP(copy.deepcopy(model))
        opt = getattr(torch.optim, optimizer)(ddp.parameters(), **kwargs)
        engine = initialize(model, optimizer=optimizer, optimizer_kwargs=kwargs,
                            config=ZeroConfig(stage=stage, bucket_mb=0.002, grad_accum_steps=accum,
                                              quantize_grads=quantize_grads, **config))
        loss_diff, norm_diff = [], []
        for step in range(steps):
            losses = [0.0, 0.0]
            for micro in range(accum):
                batch = parity_cases._batch("gpt", step, micro, rank, n, "never")
                with ddp.no_sync() if micro < accum - 1 else contextlib.nullcontext():
                    loss = parity_cases._loss(ddp(batch))
                    (loss / accum).backward()
                zl = parity_cases._loss(engine(batch))
                engine.backward(zl)
                losses[0] += float(loss) / accum
                losses[1] += float(zl) / accum
            norm = float(torch.nn.utils.clip_grad_norm_(ddp.parameters(), config.get("grad_clip") or float("inf")))
            opt.step()
            opt.zero_grad()
            norm_diff.append(abs(float(engine.step()) - norm) / norm)
            loss_diff.append(abs(losses[1] - losses[0]) / abs(losses[0]))
        ours = engine.full_state_dict(rank0_only=False)
        names = [k for k, _ in ddp.module.named_parameters()]
        ref = [p.detach() for p in ddp.module.parameters()]
        moved = sum(float((r - s0).pow(2).sum()) for r, s0 in zip(ref, start)) ** 0.5
        apart = sum(float((ours[k] - r).pow(2).sum()) for k, r in zip(names, ref)) ** 0.5
        return {"loss_diff": loss_diff, "norm_diff": norm_diff, "params_over_update": apart / moved}


def wide(ranks_per_node: int) -> dict:
    """A float64 bucket of values beyond fp32's range through Comm.reduce_scatter with ``zero.quantize_grads``:
    whether it is the exact sum (integer multiples of 2 ** 1000, about 1e301: exact in float64) and the bytes
    it sent."""
    n, r = dist.get_world_size(), dist.get_rank()
    with on_nodes(ranks_per_node):
        comm = Comm()
        comm.grad_path = path = gradient_path(comm, None, "int4", 64)
        k = 10
        x = torch.arange(n * k, dtype=torch.float64) * (r + 1) * 2.0 ** 1000
        out = torch.empty(k, dtype=torch.float64)
        comm.wait([comm.reduce_scatter(out, x)])
        expected = torch.arange(n * k, dtype=torch.float64)[r * k:(r + 1) * k] * sum(range(1, n + 1)) * 2.0 ** 1000
        return {"equal": torch.equal(out, expected), "dtype": str(out.dtype),
                "sent": sum(c.bytes_sent for c in [comm] + path.comms)}
