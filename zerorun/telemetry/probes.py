"""Measurements a rank adds to its telemetry events: host and device memory, and model FLOPs.

Everything here is cheap enough to run on every logged step (a ``/proc/meminfo`` read, the CUDA caching
allocator's counters, a few multiplications); ``benchmarks/telemetry_overhead.py`` measures the total.
"""

from __future__ import annotations

import resource
from typing import Any, Mapping

import psutil


def peak_rss_bytes() -> int:
    """Peak resident set size of this process in bytes (``ru_maxrss`` is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def host_memory() -> dict[str, int]:
    """This host's memory: ``host_mem_bytes`` (total) and ``host_mem_used_bytes`` (total minus what the kernel
    reports as available, so page cache that can be dropped does not count), both in bytes."""
    vm = psutil.virtual_memory()
    return {"host_mem_bytes": int(vm.total), "host_mem_used_bytes": int(vm.total - vm.available)}


def cuda_memory(device: Any) -> dict[str, int]:
    """The CUDA caching allocator's counters for ``device`` (a ``torch.device``), in bytes:
    ``cuda_allocated_bytes`` (held by tensors now), ``cuda_reserved_bytes`` (held by the allocator now),
    ``cuda_peak_bytes`` (most ever allocated by tensors), ``cuda_total_bytes`` (the device's memory).
    Empty on a non-CUDA device."""
    if getattr(device, "type", None) != "cuda":
        return {}
    import torch

    return {"cuda_allocated_bytes": torch.cuda.memory_allocated(device),
            "cuda_reserved_bytes": torch.cuda.memory_reserved(device),
            "cuda_peak_bytes": torch.cuda.max_memory_allocated(device),
            "cuda_total_bytes": torch.cuda.get_device_properties(device).total_memory}


class CpuUse:
    """CPU use since the previous call (the first call: since this object was made), for step events:
    ``cpu_percent`` of this process (``psutil.Process.cpu_percent``: 100 = one core busy, more with several
    threads) and ``host_cpu_percent`` of the whole host (``psutil.cpu_percent``: 100 = every core busy). Two
    reads of /proc, about 50 us."""

    def __init__(self) -> None:
        self.proc = psutil.Process()
        self.proc.cpu_percent()  # the first call only starts the interval
        self._host = psutil.cpu_times()

    def __call__(self) -> dict[str, float]:
        now = psutil.cpu_times()
        busy = lambda t: sum(t) - t.idle - getattr(t, "iowait", 0.0)  # noqa: E731 - psutil's own definition
        total = sum(now) - sum(self._host)
        host = 100.0 * (busy(now) - busy(self._host)) / total if total > 0 else 0.0
        self._host = now
        return {"cpu_percent": round(self.proc.cpu_percent(), 1), "host_cpu_percent": round(max(0.0, host), 1)}


class GpuUtilization:
    """``{"gpu_util_percent": N}``: the percent of the last sample period in which a kernel ran on ``device``
    (``torch.cuda.utilization``, NVML through the nvidia-ml-py package, or amdsmi on ROCm); ``{}`` on a
    non-CUDA device, and from the first failure on (no nvidia-ml-py: the dashboard then shows device memory
    only, and says nothing of utilization)."""

    def __init__(self, device: Any) -> None:
        self.device = device
        self.working = getattr(device, "type", None) == "cuda"

    def __call__(self) -> dict[str, int]:
        if not self.working:
            return {}
        try:
            import torch

            return {"gpu_util_percent": int(torch.cuda.utilization(self.device))}
        except Exception:  # noqa: BLE001 - ModuleNotFoundError (no nvidia-ml-py), an NVML error: not shown
            self.working = False
            return {}


def flops_per_token(n_params: int, shape: Mapping[str, Any] | None = None, seq_len: float = 0) -> float:
    """Training FLOPs per token (forward and backward) of a model with ``n_params`` trainable parameters.

    ``6 * n_params`` (Kaplan et al. 2020, §2.1: 2 per parameter in the forward pass, 4 in the backward), plus,
    when the model exposes its transformer ``shape`` (a mapping with ``n_layer`` and ``d_model``, as
    ``recipes/models/gpt.py`` does), attention's ``12 * n_layer * d_model * seq_len`` (PaLM, Chowdhery et al.
    2022, Appendix B: ``6N + 12 L H Q T`` with ``H * Q = d_model``). ``seq_len`` is the tokens per sample
    actually trained on; without it the attention term is left out. Activation recomputation is not counted
    (these are model FLOPs, not hardware FLOPs).
    """
    flops = 6.0 * n_params
    if shape and seq_len > 0:
        try:
            flops += 12.0 * int(shape["n_layer"]) * int(shape["d_model"]) * seq_len
        except (KeyError, TypeError, ValueError):
            pass  # a shape without these fields: the 6N estimate alone
    return flops
