"""Where ``zerorun estimate`` takes the memory it fits the stages into: the flags, the hostfile's hosts, or
this machine.

Note [Whose memory]: an estimate run on a laptop or a cluster's login node for the cluster's nodes must not
fit the stages into the laptop's memory (every stage said "no": issue 37). So the memory per node comes, in
this order, from ``--host-memory``/``--gpu-memory`` (``--cpu-memory``/``--device-memory``), from the
hostfile's hosts when ``-H`` is given (each asked as ``zerorun env -H`` reaches it: a local host directly, the
others over SSH in parallel, within a time bound; the smallest host's memory, since every node must fit), and
only then from this machine. The estimate's first line says which (:attr:`Memory.source`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from zerorun.errors import ZerorunError

#: the script a remote host runs: its memory (/proc/meminfo, KiB) and its GPUs' (nvidia-smi, MiB; none is fine).
PROBE = ("grep '^MemTotal:' /proc/meminfo\n"
         "nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null || true\n")


@dataclass(frozen=True)
class HostMemory:
    """One host's memory: ``host_bytes`` in all, ``gpu_bytes`` of its smallest GPU (``None``: no GPU),
    ``gpu_name`` what it is."""

    host_bytes: int
    gpu_bytes: int | None = None
    gpu_name: str = "cuda"


@dataclass(frozen=True)
class Memory:
    """What an estimate fits into: ``device_bytes`` per rank, ``device`` (``"cpu"``: host memory shared by
    the node's ranks, else a GPU's description), ``host_bytes`` per node, ``source`` (for people: where the
    numbers came from)."""

    device_bytes: int
    device: str
    host_bytes: int
    source: str


def parse_probe(host: str, text: str) -> HostMemory:
    """:data:`PROBE`'s output on ``host`` as a :class:`HostMemory`.

    Raises:
        ZerorunError: no ``MemTotal`` line (not a Linux host), naming ``host``.
    """
    host_bytes, gpus = None, []
    for line in text.splitlines():
        words = line.split()
        if line.startswith("MemTotal:") and len(words) >= 2 and words[1].isdigit():
            host_bytes = int(words[1]) * 1024
        elif len(words) == 1 and words[0].isdigit():
            gpus.append(int(words[0]) * 2**20)
    if host_bytes is None:
        raise ZerorunError(f"{host}: cannot read its memory (no MemTotal in /proc/meminfo)")
    return HostMemory(host_bytes, min(gpus) if gpus else None, "cuda (nvidia-smi)")


def detect_memory(procs_per_node: int) -> tuple[int, str, int]:
    """``(device bytes per rank, device description, host bytes per node)`` of this machine: the first CUDA
    device's memory, or on a CPU-only machine host memory divided by ``procs_per_node``. torch (seconds to
    import) is asked only on a machine with a GPU driver's device files (NVIDIA's or AMD's)."""
    import os

    import psutil

    host = psutil.virtual_memory().total
    if not any(os.path.exists(p) for p in ("/dev/nvidia0", "/dev/nvidiactl", "/dev/kfd", "/proc/driver/nvidia")):
        return host // procs_per_node, "cpu", host
    try:
        import torch

        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            return props.total_memory, f"cuda ({props.name}, detected)", host
    except Exception:  # noqa: BLE001 - no usable CUDA: fall back to host memory
        pass
    return host // procs_per_node, "cpu", host


def local_memory() -> HostMemory:
    """This machine's memory; its first CUDA device's when it has one (:func:`detect_memory`)."""
    dev, kind, host = detect_memory(1)
    return HostMemory(host, None if kind == "cpu" else dev, kind)


def ask_hosts(hostfile: str, ssh=None, timeout: float = 15.0) -> dict[str, HostMemory]:
    """The memory of every host of ``hostfile``: local hosts measured here, the others over SSH
    (launch/remote.py, ``ssh`` a ``SshOptions``) in parallel within ``timeout`` seconds.

    Raises:
        ZerorunError: a bad hostfile; a host that does not answer, one line naming it, the cause and
            ``--host-memory``.
    """
    from zerorun.recipe.hostfile import read_hostfile
    from zerorun.launch.preflight import describe_connect_error
    from zerorun.launch.remote import SshOptions, connect, run_script

    hosts = read_hostfile(hostfile)
    opts = ssh or SshOptions()
    found: dict[str, HostMemory | str] = {}

    def probe(name: str) -> None:
        conn = None
        try:
            conn = connect(name, opts)
            status, out = run_script(conn, PROBE, timeout)
            found[name] = parse_probe(name, out) if status == 0 else f"its memory probe exited {status}"
        except ZerorunError as e:
            found[name] = str(e).split(": ", 1)[-1]
        except Exception as e:  # noqa: BLE001 - every failure is one line
            found[name] = describe_connect_error(e, name, opts)
        finally:
            if conn is not None:
                conn.close()

    threads = []
    for h in hosts:
        if h.is_local:
            found[h.name] = local_memory()
        elif h.name not in found:
            found[h.name] = "?"
            threads.append(threading.Thread(target=probe, args=(h.name,), daemon=True))
            threads[-1].start()
    for t in threads:
        t.join(timeout)
    for h in hosts:
        got = found.get(h.name)
        if not isinstance(got, HostMemory):
            cause = f"no answer within {timeout:g} s" if got in (None, "?") else got
            raise ZerorunError(f"estimate: -H {hostfile}: host {h.name}: {cause} (its memory is needed; or give "
                               "--host-memory and --gpu-memory)")
    return {name: m for name, m in found.items() if isinstance(m, HostMemory)}


def from_hosts(found: dict[str, HostMemory], procs_per_node: int) -> Memory:
    """The smallest host's memory (Note [Whose memory]); GPUs when every host has one, else the host memory
    shared by ``procs_per_node`` ranks."""
    smallest = min(found, key=lambda n: found[n].host_bytes)
    host = found[smallest].host_bytes
    names = ", ".join(found)
    gpus = [m.gpu_bytes for m in found.values()]
    if all(g is not None for g in gpus):
        gpu = min(gpus)
        kind = next(m.gpu_name for m in found.values() if m.gpu_bytes == gpu)
        return Memory(gpu, kind, host, f"the hostfile's hosts ({names}; the smallest)")
    return Memory(host // procs_per_node, "cpu", host,
                  f"the hostfile's hosts ({names}; the smallest: {smallest}; no GPU on "
                  + ", ".join(n for n, m in found.items() if m.gpu_bytes is None) + ")")


def choose(*, hostfile: str | None, ssh, procs_per_node: int, device_memory: int | None,
           host_memory: int | None) -> Memory:
    """The :class:`Memory` of Note [Whose memory]: the flags' values (``device_memory`` per rank,
    ``host_memory`` per node, in bytes; ``None``: not given), the rest from ``hostfile``'s hosts when given,
    else from this machine. On a CPU-only node the device memory per rank is the node's memory shared by
    its ``procs_per_node`` ranks (``host_memory``'s when given).

    Raises:
        ZerorunError: see :func:`ask_hosts`.
    """
    if device_memory is not None and host_memory is not None:
        return Memory(device_memory, "given", host_memory, "--gpu-memory and --host-memory")
    if hostfile:
        got = from_hosts(ask_hosts(hostfile, ssh), procs_per_node)
    else:
        m = local_memory()
        got = Memory(m.gpu_bytes, m.gpu_name, m.host_bytes, "this machine (localhost)") if m.gpu_bytes else \
            Memory(m.host_bytes // procs_per_node, "cpu", m.host_bytes, "this machine (localhost)")
    if got.device == "cpu" and device_memory is None and host_memory is not None:
        got = Memory(host_memory // procs_per_node, "cpu", host_memory, got.source)  # the given host's ranks
    given = [flag for flag, v in (("--gpu-memory", device_memory), ("--host-memory", host_memory)) if v is not None]
    return Memory(device_memory if device_memory is not None else got.device_bytes,
                  "given" if device_memory is not None else got.device,
                  host_memory if host_memory is not None else got.host_bytes,
                  " and ".join(given + [got.source]))
