"""Ranks per node as a number or a word (``launch.procs_per_node``, ``--nproc-per-node``), and the GPUs this
machine's ranks can see, counted without importing torch.

Note [Ranks per node]: a count is ``N`` (1 to :data:`~zerorun.recipe.hostfile.MAX_SLOTS`) or one of torchrun's words
(torch/distributed/run.py ``determine_local_world_size``):

- ``gpu``: one rank per visible GPU; none visible is an error (torchrun: "Cuda is not available.").
- ``cpu``: one rank per CPU this process may run on (``os.sched_getaffinity``, as torchrun's
  ``torch._utils.cpu_count``).
- ``auto`` (``launch.procs_per_node``'s default): one rank per visible GPU where the node has one, else 1.
  torchrun's ``auto`` gives one rank per CPU on a machine without GPUs; zerorun keeps 1 there (its default
  before ``auto``): a ZeRO rank per core would hold a model replica's buffers per core.

Where a word becomes a number, once, before the plan is made, so that ``--dry-run`` prints the job that runs:

- no hostfile (this machine; ``--launcher local``): here, by the launcher, which runs the ranks here too.
- a hostfile: each host's ``slots=`` are its ranks (DeepSpeed's: one per GPU); ``auto`` and ``gpu`` take all
  of them, ``cpu`` is refused in one line (a remote host's CPUs are not known before contacting it, and the
  dry run contacts no host).
- a SLURM allocation: Note [Ranks in an allocation] in launch/slurm.py; ``zerorun submit``: Note [Ranks of a
  submitted job] in zerorun/slurm/sbatch.py.

Visible GPUs: NVML's device count (``libnvidia-ml.so.1`` through ctypes, as torch's own
``torch.cuda._raw_device_count_nvml``; importing torch would cost the launcher seconds before its first line),
narrowed by ``CUDA_VISIBLE_DEVICES`` as CUDA reads it (torch.cuda ``_parse_visible_devices``): ordinals up to
the first bad or out-of-range one, a repeated one hides every device, ``GPU-``/``MIG-`` UUIDs counted as
given (at most the devices NVML sees). No NVIDIA driver: 0 GPUs. AMD GPUs (ROCm) are not counted: give a
number.
"""

from __future__ import annotations

import os
from typing import Callable

from zerorun.errors import ZerorunError
from zerorun.recipe.hostfile import MAX_SLOTS, Host


def nvml_gpus() -> int:
    """NVIDIA GPUs NVML sees on this machine (before ``CUDA_VISIBLE_DEVICES``); 0 without a driver or NVML."""
    import ctypes

    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
        if nvml.nvmlInit_v2() != 0:
            return 0
        count = ctypes.c_uint(0)
        ok = nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) == 0
        nvml.nvmlShutdown()
    except (OSError, AttributeError):
        return 0
    return count.value if ok else 0


def visible_gpus(environ=None, physical: Callable[[], int] | None = None) -> int:
    """GPUs a rank started with ``environ`` (default ``os.environ``) sees: ``physical()`` (default
    :func:`nvml_gpus`) narrowed by ``CUDA_VISIBLE_DEVICES`` (Note [Ranks per node])."""
    env = os.environ if environ is None else environ
    present = (physical or nvml_gpus)()
    spec = env.get("CUDA_VISIBLE_DEVICES")
    if spec is None or present <= 0:
        return max(present, 0)
    seen: list[str] = []
    for item in (x.strip() for x in spec.split(",")):
        if item.startswith(("GPU-", "MIG-")):
            key = item
        else:
            digits = item[1:] if item[:1] == "+" else item
            digits = digits[:len(digits) - len(digits.lstrip("0123456789"))]
            if not digits or int(digits) >= present:
                break  # CUDA stops at the first bad or absent ordinal
            key = str(int(digits))
        if key in seen:
            return 0  # a repeated device hides them all
        seen.append(key)
    return min(len(seen), present)


def cpus() -> int:
    """CPUs this process may run on, as torchrun's ``cpu`` counts them."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def resolve(value: int | str, name: str, environ=None) -> int:
    """Ranks on this machine for ``value`` (Note [Ranks per node]), for ranks started with ``environ`` (default
    ``os.environ``; the job's ``launch.env`` may set ``CUDA_VISIBLE_DEVICES``).

    Raises:
        ZerorunError: ``gpu`` where no GPU is visible, or a count above :data:`MAX_SLOTS` (``name`` named).
    """
    env = os.environ if environ is None else environ
    if isinstance(value, int):
        return value
    count = visible_gpus(env) if value in ("auto", "gpu") else cpus()
    if value == "gpu" and not count:
        shown = env.get("CUDA_VISIBLE_DEVICES")
        hidden = f" (CUDA_VISIBLE_DEVICES={shown!r})" if shown is not None else ""
        raise ZerorunError(f"{name} gpu: no GPU visible on this machine{hidden}; give a number of ranks")
    count = count or 1  # auto on a machine without GPUs
    if count > MAX_SLOTS:
        raise ZerorunError(f"{name} {value}: {count} ranks, more than {MAX_SLOTS}; give a number of ranks")
    return count


def auto_note(value: int | str, name: str, ranks: int) -> str | None:
    """A stderr line saying what a word became, when it is not the old default of one rank, else None."""
    if isinstance(value, int) or ranks == 1 and value == "auto":
        return None
    from zerorun.telemetry.format import count

    what = "CPU" if value == "cpu" else "visible GPU"
    return f"zerorun: {name} {value}: {count(ranks, 'rank')} on this machine, one per {what}"


def through_visible(host: Host, environ=None) -> Host:
    """``host`` (this machine) with its selected slots (``--include localhost:0,2``) named as the devices this
    machine's ``CUDA_VISIBLE_DEVICES`` lists at those places: its slots were counted among those devices
    (``CUDA_VISIBLE_DEVICES=4,5,6`` and ``localhost:0,2``: ``4,6``, not GPUs 0 and 2). Unchanged without
    selected slots, without the variable, or with a slot past its list."""
    spec = (os.environ if environ is None else environ).get("CUDA_VISIBLE_DEVICES")
    if host.slot_ids is None or spec is None:
        return host
    devices = [x.strip() for x in spec.split(",")]
    if max(host.slot_ids) >= len(devices):
        return host
    return Host(host.name, host.slots, tuple(devices[i] for i in host.slot_ids))


def hostfile_procs(value: int | str | None, name: str) -> int | None:
    """``--nproc-per-node`` with a hostfile: a number caps each host's slots; ``auto``/``gpu`` take them all
    (None).

    Raises:
        ZerorunError: ``cpu`` (Note [Ranks per node]).
    """
    if value == "cpu":
        raise ZerorunError(f"{name} cpu: with a hostfile each host runs its slots= ranks; give a number to use "
                           "fewer")
    return value if isinstance(value, int) else None


def assumed(value: int | str, name: str) -> tuple[int, str | None]:
    """Ranks per node for a plan made without the nodes (``zerorun estimate``): a number as given; a word
    counted on this machine (``gpu`` without GPUs here: 1), with a line saying what was assumed (else None)."""
    if isinstance(value, int):
        return value, None
    found = visible_gpus() if value in ("auto", "gpu") else cpus()
    what = "CPUs" if value == "cpu" else "visible GPUs"
    ranks = max(1, min(found, MAX_SLOTS))
    return ranks, (f"{name} {value}: assumed {ranks} per node ({found} {what} on this machine); give "
                   "--procs-per-node N for another count")
