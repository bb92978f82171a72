"""``zerorun env``: what a bug report needs, as DeepSpeed's ``ds_report`` prints it: versions (zerorun, python,
torch and the libraries the launcher uses), torch's distributed backends, the CPU and GPUs, and with a
hostfile, whether each host is reachable (local hosts without SSH, the others over SSH, in parallel, within
a time bound)."""

from __future__ import annotations

import inspect
import os
import platform
import sys
import threading
from importlib import metadata

#: distributions whose versions are reported (missing ones say so).
PACKAGES = ("torch", "typer", "pydantic", "rich", "fabric", "paramiko", "psutil", "safetensors", "transformers",
            "matplotlib", "cmeel-mimalloc")


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def _cpu() -> str:
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores"


def _memory() -> str:
    import psutil

    return f"{psutil.virtual_memory().total / 2**30:.1f} GiB"


def torch_lines() -> list[tuple[str, str]]:
    """torch's version, build, backends and devices (imports torch: seconds)."""
    try:
        import torch
        import torch.distributed as dist
    except Exception as e:  # noqa: BLE001 - a broken torch is what the report is for
        return [("torch", f"cannot import: {type(e).__name__}: {e}")]
    out = [("torch", f"{torch.__version__} ({os.path.dirname(torch.__file__)})"),
           ("torch CUDA / HIP build", f"{torch.version.cuda or '-'} / {getattr(torch.version, 'hip', None) or '-'}")]
    backends = [name for name, ok in (("gloo", dist.is_gloo_available()), ("nccl", dist.is_nccl_available()),
                                      ("mpi", dist.is_mpi_available())) if ok]
    out.append(("distributed backends", ", ".join(backends) or "none"))
    out.append(("GPUs", gpu_text(cuda_devices())))
    if torch.cuda.is_available():
        out.append(("NCCL", ".".join(map(str, torch.cuda.nccl.version())) if dist.is_nccl_available() else "-"))
    return out


def auto_line(environ=None) -> tuple[str, str]:
    """``("procs_per_node auto", ...)``: the ranks ``auto`` starts on this machine and the GPUs it counted
    (NVML, ``CUDA_VISIBLE_DEVICES``: Note [Ranks per node] in zerorun/launch/slots.py), torch-free."""
    from zerorun.launch.slots import nvml_gpus, visible_gpus

    env = os.environ if environ is None else environ
    seen, present = visible_gpus(env), nvml_gpus()
    shown = f", CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']}" if "CUDA_VISIBLE_DEVICES" in env else ""
    ranks = max(seen, 1)
    return "procs_per_node auto", f"{ranks} rank{'s' * (ranks != 1)} ({seen} of the {present} GPUs NVML finds{shown})"


def cuda_devices() -> list[list] | str:
    """``[name, memory bytes]`` of every GPU torch.cuda sees here (``CUDA_VISIBLE_DEVICES`` applied), or why
    none can be listed (torch does not import); stdlib and torch only: it is the GPU probe run on remote
    hosts too (:func:`remote_gpus`)."""
    try:
        import torch
    except Exception as e:  # noqa: BLE001 - a broken torch is what the report is for
        return f"cannot import torch: {type(e).__name__}: {e}"
    if not torch.cuda.is_available():
        return []
    found = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        found.append([props.name, props.total_memory])
    return found


def gpu_text(devices: list[list] | str) -> str:
    """``cuda_devices()``'s answer in words: ``2: NVIDIA H200, 139.8 GiB x 2``, ``no GPU (CUDA not
    available)``, or why they are unknown."""
    if isinstance(devices, str):
        return f"unknown ({devices})"
    if not devices:
        return "no GPU (CUDA not available)"
    kinds: dict[tuple[str, int], int] = {}
    for name, memory in devices:
        kinds[(name, memory)] = kinds.get((name, memory), 0) + 1
    return f"{len(devices)}: " + "; ".join(f"{name}, {memory / 2**30:.1f} GiB" + (f" x {n}" if n > 1 else "")
                                           for (name, memory), n in kinds.items())


def remote_gpus(conn, timeout: float) -> str:
    """:func:`gpu_text` of the host at the end of ``conn`` (a fabric connection), found by running
    :func:`cuda_devices` there with this interpreter's path and the environment a job forwards (launch/env.py:
    ``CUDA_VISIBLE_DEVICES`` included), within ``timeout`` seconds."""
    import json

    from zerorun.launch.env import allowed_env
    from zerorun.launch.remote import run_script, shell_script

    probe = "import json\n" + inspect.getsource(cuda_devices) + "print('@zerorun-gpus ' + json.dumps(cuda_devices()))"
    status, out = run_script(conn, shell_script([sys.executable, "-c", probe], allowed_env()), timeout)
    line = next((x for x in reversed(out.splitlines()) if x.startswith("@zerorun-gpus ")), None)
    if line is None:
        last = out.strip().splitlines()[-1] if out.strip() else f"no answer within {timeout:g} s"
        return f"unknown ({sys.executable} -c: exit status {status}: {last})"
    return gpu_text(json.loads(line.split(" ", 1)[1]))


def allocator_line(environ: dict[str, str] | None = None) -> tuple[str, str]:
    """``("rank allocator", what this node's ranks run under)`` (Note [Rank allocator]): the allocator this
    node's watcher gives ranks whose environment is ``environ`` (default ``os.environ``), its library, and where
    that is the slow fallback, what to install; a bad ``ZERORUN_ALLOCATOR`` or a missing library is said."""
    from zerorun.allocator import (ALLOCATOR_VAR, INSTALL_HINT, allocator_env, fallback_note, find_mimalloc,
                                   find_tcmalloc, rank_env)

    env = dict(os.environ if environ is None else environ)
    try:
        env = {**env, **rank_env(env)}
        resolved = allocator_env(env, find_tcmalloc(), find_mimalloc())
    except Exception as e:  # noqa: BLE001 - ZerorunError or ValueError: the report says why
        return "rank allocator", f"none: {e}"
    name = resolved[ALLOCATOR_VAR]
    where = {"tcmalloc": f" ({resolved.get('LD_PRELOAD')})", "mimalloc": f" ({resolved.get('LD_PRELOAD')})",
             "preload": f" (the job's LD_PRELOAD={resolved.get('LD_PRELOAD') or env.get('LD_PRELOAD')})",
             "glibc": " tuned"}[name]
    slow = fallback_note(env, resolved, "this node") is not None
    return "rank allocator", (f"{name}{where}, {ALLOCATOR_VAR}={env[ALLOCATOR_VAR]}"
                              + (f"; the slow fallback: install {INSTALL_HINT}" if slow else ""))


def check_hosts(hostfile: str, ssh=None, timeout: float = 30.0, local_gpus: str = "") -> list[tuple[str, str]]:
    """``(host, "reachable over SSH; GPUs: ..." | "local (no SSH); GPUs: ..." | one-line cause)`` for every
    host of ``hostfile``: local hosts run without SSH (their GPUs: ``local_gpus``, this machine's
    :func:`gpu_text`); the others are connected to over SSH (launch/remote.py) and asked for their GPUs
    (:func:`remote_gpus`), all in parallel, within ``timeout`` seconds (torch imports there).

    Raises:
        ZerorunError: an unreadable or bad hostfile.
    """
    import time

    from zerorun.recipe.hostfile import read_hostfile
    from zerorun.launch.preflight import describe_connect_error
    from zerorun.launch.remote import SshOptions, connection

    hosts = read_hostfile(hostfile)
    opts = ssh or SshOptions()
    found: dict[str, str] = {}
    deadline = time.monotonic() + timeout

    def probe(name: str) -> None:
        conn = None
        try:
            conn = connection(name, opts)
            conn.open()
        except Exception as e:  # noqa: BLE001 - every failure is one line
            found[name] = describe_connect_error(e, name, opts)
        else:  # said once the GPUs are known: a late answer is "no answer", not reachable without GPUs
            found[name] = "reachable over SSH; GPUs: " + remote_gpus(conn, max(1.0, deadline - time.monotonic() - 1))
        finally:
            if conn is not None:
                conn.close()

    threads = {}
    for h in hosts:
        if h.is_local:
            found[h.name] = "local (no SSH)" + (f"; GPUs: {local_gpus}" if local_gpus else "")
        else:
            threads[h.name] = threading.Thread(target=probe, args=(h.name,), daemon=True)
            threads[h.name].start()
    for name, t in threads.items():
        t.join(max(0.0, deadline - time.monotonic()))
        found.setdefault(name, f"no answer within {timeout:g} s")
    return [(f"host {h.name} (slots={h.slots})", found[h.name]) for h in hosts]


def report(hostfile: str | None = None, ssh=None) -> str:
    """The whole report as aligned ``name  value`` lines."""
    return aligned(report_lines(hostfile, ssh))


def aligned(lines: list[tuple[str, str]]) -> str:
    """The report's rows as aligned ``name  value`` lines."""
    width = max(len(k) for k, _ in lines)
    return "".join(f"{k.ljust(width)}  {v}\n" for k, v in lines)


def unreachable(lines: list[tuple[str, str]]) -> list[str]:
    """The hosts of :func:`report_lines` that did not answer (``host NAME (slots=N)`` rows not reachable)."""
    return [k.split()[1] for k, v in lines if k.startswith("host ") and not v.startswith(("reachable", "local"))]


def report_lines(hostfile: str | None = None, ssh=None) -> list[tuple[str, str]]:
    """The report's ``(name, value)`` rows."""
    import zerorun

    lines = [("zerorun", f"{zerorun.__version__} ({os.path.dirname(zerorun.__file__)})"),
             ("python", f"{platform.python_version()} ({sys.executable})"),
             ("platform", platform.platform()), ("CPU", _cpu()), ("memory", _memory()), allocator_line()]
    lines += [*torch_lines(), auto_line()]
    lines += [(name, _version(name)) for name in PACKAGES if name != "torch"]
    if hostfile:
        lines += check_hosts(hostfile, ssh, local_gpus=dict(lines).get("GPUs", ""))
    return lines
