"""``zerorun launch script.py`` on local ranks: the user's script, its arguments, its errors."""

import subprocess
import sys

import pytest

from test_train_e2e import job_id, read_events, survivors

pytestmark = pytest.mark.slow

SCRIPT = """
import os, sys
import zerorun
rank = int(os.environ["RANK"])
print("args", sys.argv[1:])
zerorun.report(1, 1.5, steps=2)
if rank == 1:
    raise ValueError("bad shard " + sys.argv[2])
"""


def test_script_runs_on_every_rank_and_its_exception_is_named(tmp_path):
    (tmp_path / "s.py").write_text(SCRIPT)
    out = subprocess.run([sys.executable, "-m", "zerorun", "launch", "--num-procs", "2", "--log-dir",
                          str(tmp_path / "runs"), "s.py", "--shard", "7"], cwd=str(tmp_path), capture_output=True,
                         text=True, timeout=180)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "2 ranks on localhostx2, user script" in out.stdout
    assert "[rank 0] args ['--shard', '7']" in out.stdout  # options after the script are the script's
    assert out.stderr.startswith(f"zerorun: error: rank 1 on localhost: ValueError: bad shard 7 (at "
                                 f"{tmp_path / 's.py'}:8 in <module>)"), out.stderr
    events = read_events(tmp_path / "runs")
    assert {e["rank"] for e in events if e["event"] == "step"} == {0, 1}
    starts = [e for e in events if e["event"] == "start"]  # a script's ranks start like the built-in worker's
    assert sorted(e["rank"] for e in starts) == [0, 1] and all(e["world_size"] == 2 for e in starts), starts
    from zerorun.launch.plan import find_tcmalloc  # Note [Rank allocator]: a script's ranks get it too

    assert {e["allocator"] for e in starts} == {"tcmalloc" if find_tcmalloc() else "mimalloc"}, starts
    assert "2 ranks started (torch " in out.stdout
    assert survivors(job_id(out.stdout)) == []
