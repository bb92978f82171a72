"""Parsing and formatting of counts, bytes and bandwidths for ``zerorun estimate``."""

from __future__ import annotations

import math
import re

from zerorun.errors import ZerorunError
from zerorun.recipe.hostfile import MAX_SLOTS


# ------------------------------------------------------------------------------------------------- sizes
_NUMBER = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z/]*)\s*")  # fullmatch
_COUNT_UNITS = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}
_BYTE_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_BIT_PREFIX = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


def _split(text: str, flag: str, example: str) -> tuple[float, str]:
    m = _NUMBER.fullmatch(str(text))
    if not m:
        raise ZerorunError(f"{flag}: cannot read {text!r}: expected a number with a unit, e.g. {example}")
    value = float(m.group(1))
    if not math.isfinite(value) or value > 1e30:  # 1e400 parses as inf; no model, memory or link is that big
        raise ZerorunError(f"{flag}: {text!r} is too large")
    return value, m.group(2)


#: the largest count of parameters :func:`parse_count` takes (a thousand T).
MAX_COUNT = 10**15
#: the most nodes, ranks per node and ranks ``zerorun estimate`` takes: beyond today's largest jobs (~100k GPUs);
#: ``--nodes 100000000`` took minutes and 11 GB, the rank count beyond that a MemoryError.
MAX_NODES, MAX_PROCS_PER_NODE, MAX_RANKS = 100_000, MAX_SLOTS, 1_000_000  # per node: as a hostfile's slots


def check_ranks(nodes: int, procs_per_node: int, node_ranks: tuple[int, ...] = ()) -> None:
    """Raises ZerorunError: ``nodes`` above :data:`MAX_NODES`, ``procs_per_node`` above
    :data:`MAX_PROCS_PER_NODE`, or more ranks in all (``node_ranks``' sum when given) than :data:`MAX_RANKS`."""
    if nodes > MAX_NODES:
        raise ZerorunError(f"--nodes {nodes}: more than {MAX_NODES:,} nodes")
    if procs_per_node > MAX_PROCS_PER_NODE:
        raise ZerorunError(f"--procs-per-node {procs_per_node}: more than {MAX_PROCS_PER_NODE:,} ranks per node")
    ranks = sum(node_ranks) if node_ranks else nodes * procs_per_node
    if ranks > MAX_RANKS:
        raise ZerorunError(f"--nodes {nodes} x --procs-per-node {procs_per_node}: {ranks:,} ranks, more than "
                           f"{MAX_RANKS:,}")


def parse_count(text: str, flag: str = "--params") -> int:
    """A count such as ``7B``, ``350M``, ``1.5K`` or ``1000`` (decimal prefixes: K 1e3, M 1e6, B/G 1e9, T 1e12).

    Raises:
        ZerorunError: not a positive count, a fraction without a unit (``7.5``), or more than :data:`MAX_COUNT`;
            the message names ``flag``.
    """
    count = _scaled(text, flag, _COUNT_UNITS, "7B, 350M", "a positive count such as 7B, 350M or 125000",
                    whole="parameters")
    if count > MAX_COUNT:  # 1e30 printed "1e+18T" parameters and a headroom of -6e22 %
        raise ZerorunError(f"{flag}: {text!r} is more than {MAX_COUNT // 10**12:,}T parameters")
    return count


def parse_bytes(text: str, flag: str = "--device-memory") -> int:
    """A size in bytes: ``80GiB`` (binary: KiB, MiB, GiB, TiB), ``80GB`` (decimal: KB, MB, GB, TB) or ``80B``;
    a number without a unit is refused (``--gpu-memory 80`` was read as 80 bytes).

    Raises:
        ZerorunError: not a positive size; the message names ``flag``.
    """
    return _scaled(text, flag, _BYTE_UNITS, "80GiB, 80GB", "a positive size such as 80GiB, 80GB or 512MiB")


def _scaled(text: str, flag: str, units: dict[str, float], example: str, expected: str,
            whole: str | None = None) -> int:
    """``text`` read with ``units`` as a positive whole number; ``whole`` (what is counted): a number without a
    unit must be whole (``7.5`` was rounded to 8 parameters)."""
    value, unit = _split(text, flag, example)
    mult = units.get(unit.upper())
    if mult is None or value <= 0 or round(value * mult) < 1:
        raise ZerorunError(f"{flag}: cannot read {text!r}: expected {expected}")
    if whole and unit == "" and value != int(value):
        raise ZerorunError(f"{flag}: {text!r} is not a whole number of {whole} (with a unit: {text}B, {text}M)")
    return int(round(value * mult))


def parse_bandwidth(text: str, flag: str = "--bandwidth") -> float:
    """A link speed per rank: bits per second (``100Gbps``, ``400Mbps``) or bytes per second (``12.5GB/s``,
    ``10GiB/s``). Returns bytes per second (float).

    Raises:
        ZerorunError: not a positive speed; the message names ``flag``.
    """
    value, unit = _split(text, flag, "100Gbps, 12.5GB/s")
    u = unit.upper()
    mult = None
    if u.endswith("BPS") and unit[-3] == "b":  # bits: Gbps
        prefix = _BIT_PREFIX.get(u[:-3])
        mult = prefix / 8 if prefix else None
    elif u.endswith("/S"):
        mult = _BYTE_UNITS.get(u[:-2]) if u[:-2] else None
    if mult is None or value <= 0:
        raise ZerorunError(f"{flag}: cannot read {text!r}: expected a positive speed such as 100Gbps or 12.5GB/s")
    return value * mult


def format_bytes(n: float) -> str:
    """``n`` bytes with a binary unit: ``'1.50 GiB'``."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def format_count(n: int) -> str:
    """``n`` elements with a decimal suffix: ``'7.50B'``, ``'54.7M'``."""
    for unit, size in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)
