"""Every script in benchmarks/ starts: ``python benchmarks/X.py --help`` exits 0 with its usage. The scripts
are run by hand (docs/benchmarks.md gives their commands), so nothing else would notice one that no longer
starts: ``zero_stages.py`` (and the two scripts that import it) once failed at import with a NameError, a
comment wrapped onto a line of its own."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = sorted(f for f in os.listdir(os.path.join(ROOT, "benchmarks")) if f.endswith(".py"))


@pytest.mark.parametrize("script", SCRIPTS)
def test_benchmark_script_starts(script):
    out = subprocess.run([sys.executable, os.path.join("benchmarks", script), "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "usage" in out.stdout.lower(), out.stdout[-800:] + out.stderr[-1500:]
