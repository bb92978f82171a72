"""``zerorun env``: what a bug report needs, as DeepSpeed's ``ds_report`` prints it: versions (zerorun, python,
torch and the libraries the launcher uses), torch's distributed backends, the CPU and GPUs, and with a
hostfile, whether each host is reachable (local hosts without SSH, the others over SSH, in parallel, within
a time bound)."""

from __future__ import annotations

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
    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        nccl = ".".join(map(str, torch.cuda.nccl.version())) if dist.is_nccl_available() else "-"
        out += [("GPUs", f"{len(names)}: " + "; ".join(names)), ("NCCL", nccl)]
    else:
        out.append(("GPUs", "none (CUDA not available)"))
    return out


def allocator_line(environ: dict[str, str] | None = None) -> tuple[str, str]:
    """``("rank allocator", what this node's ranks run under)`` (Note [Rank allocator]): the allocator this
    node's watcher gives ranks whose environment is ``environ`` (default ``os.environ``), its library, and where
    that is the slow fallback, what to install; a bad ``ZERORUN_ALLOCATOR`` or a missing library is said."""
    from zerorun.launch.plan import ALLOCATOR_VAR, allocator_env, fallback_note, find_tcmalloc, rank_env
    from zerorun.zero.allocator import INSTALL_HINT, find_mimalloc

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


def check_hosts(hostfile: str, ssh=None, timeout: float = 10.0) -> list[tuple[str, str]]:
    """``(host, "reachable" | "local" | one-line cause)`` for every host of ``hostfile``: local hosts run
    without SSH; the others are connected to over SSH (launch/remote.py), all in parallel, within
    ``timeout`` seconds.

    Raises:
        ZerorunError: an unreadable or bad hostfile.
    """
    from zerorun.hostfile import read_hostfile
    from zerorun.launch.preflight import describe_connect_error
    from zerorun.launch.remote import SshOptions, connection

    hosts = read_hostfile(hostfile)
    opts = ssh or SshOptions()
    found: dict[str, str] = {}

    def probe(name: str) -> None:
        conn = None
        try:
            conn = connection(name, opts)
            conn.open()
            found[name] = "reachable over SSH"
        except Exception as e:  # noqa: BLE001 - every failure is one line
            found[name] = describe_connect_error(e, name, opts)
        finally:
            if conn is not None:
                conn.close()

    threads = {}
    for h in hosts:
        if h.is_local:
            found[h.name] = "local (no SSH)"
        else:
            threads[h.name] = threading.Thread(target=probe, args=(h.name,), daemon=True)
            threads[h.name].start()
    for name, t in threads.items():
        t.join(timeout)
        found.setdefault(name, f"no answer within {timeout:g} s")
    return [(f"host {h.name} (slots={h.slots})", found[h.name]) for h in hosts]


def report(hostfile: str | None = None, ssh=None) -> str:
    """The whole report as aligned ``name  value`` lines."""
    import zerorun

    lines = [("zerorun", f"{zerorun.__version__} ({os.path.dirname(zerorun.__file__)})"),
             ("python", f"{platform.python_version()} ({sys.executable})"),
             ("platform", platform.platform()), ("CPU", _cpu()), ("memory", _memory()), allocator_line()]
    lines += torch_lines()
    lines += [(name, _version(name)) for name in PACKAGES if name != "torch"]
    if hostfile:
        lines += check_hosts(hostfile, ssh)
    width = max(len(k) for k, _ in lines)
    return "".join(f"{k.ljust(width)}  {v}\n" for k, v in lines)
