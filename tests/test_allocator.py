"""zerorun.zero.allocator: glibc's malloc_trim and mallopt from inside a rank (Note [Returning freed memory])."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                reason="glibc's allocator only")

# A fresh interpreter: 96 MiB in 64 KiB blocks (below glibc's mmap threshold: served from the heap), then a
# small block above them so that freeing them leaves a hole in the middle of the heap, which glibc keeps
# resident (only a free top is returned by itself).
HOLE = """
import json, sys
from zerorun.zero import allocator
base = allocator.rss_bytes()
blocks = [bytearray(64 << 10) for _ in range(1536)]
pin = bytearray(100 << 10)
full = allocator.rss_bytes()
del blocks
freed = allocator.rss_bytes()
released = allocator.trim()
trimmed = allocator.rss_bytes()
print(json.dumps({"base": base, "full": full, "freed": freed, "trimmed": trimmed, "released": released}))
"""


def _run(code: str, env: dict | None = None) -> dict:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


def test_trim_returns_a_freed_hole_in_the_heap():
    r = _run(HOLE)
    mib = 1 << 20
    assert r["full"] - r["base"] > 90 * mib, r
    assert r["freed"] - r["base"] > 80 * mib, f"glibc returned the hole by itself: {r}"
    assert r["released"] is True
    assert r["freed"] - r["trimmed"] > 80 * mib, f"trim() did not give the hole back: {r}"


def test_rss_bytes_is_this_process_resident_size():
    r = _run("import json, resource\nfrom zerorun.zero import allocator\n"
             "print(json.dumps({'rss': allocator.rss_bytes(), "
             "'max': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))")
    assert 0 < r["rss"] <= r["max"] * 1.05
