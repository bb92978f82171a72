"""Environment files for the ranks (launch/env.py): a DeepSpeed user's ``.deepspeed_env`` is read where
DeepSpeed reads it, before zerorun's own ``.zerorun_env``, and a note names every file used."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from zerorun.errors import ZerorunError
from zerorun.launch.env import env_file_paths, env_file_values


@pytest.fixture
def places(tmp_path, monkeypatch):
    home, here = tmp_path / "home", tmp_path / "here"
    home.mkdir(), here.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("DS_ENV_FILE", raising=False)
    monkeypatch.chdir(here)
    return home, here


def test_deepspeed_env_is_read_like_zerorun_env(places):
    home, here = places
    (home / ".deepspeed_env").write_text("A=ds-home\nB=ds-home\nNCCL_IB_HCA=mlx5_0\n")
    (here / ".deepspeed_env").write_text("B=ds-here\nC=ds-here\n")
    (home / ".zerorun_env").write_text("C=zr-home\n")
    notes = []
    assert env_file_values(note=notes.append) == {"A": "ds-home", "B": "ds-here", "C": "zr-home",
                                                  "NCCL_IB_HCA": "mlx5_0"}
    assert notes == [f"zerorun: note: 3 variable(s) for the ranks from DeepSpeed's environment file "
                     f"{home / '.deepspeed_env'}",
                     f"zerorun: note: 2 variable(s) for the ranks from DeepSpeed's environment file "
                     f"{here / '.deepspeed_env'}",
                     f"zerorun: note: 1 variable(s) for the ranks from environment file {home / '.zerorun_env'}"]


def test_ds_env_file_names_the_file_as_in_deepspeed(places, monkeypatch, tmp_path):
    home, here = places
    monkeypatch.setenv("DS_ENV_FILE", "cluster.env")
    (home / "cluster.env").write_text("X=1\n")
    (home / ".deepspeed_env").write_text("Y=ignored\n")
    assert env_file_values(note=lambda m: None) == {"X": "1"}
    monkeypatch.setenv("DS_ENV_FILE", str(tmp_path / "abs.env"))
    (tmp_path / "abs.env").write_text("Z=2\n")
    assert env_file_paths()[0] == str(tmp_path / "abs.env")
    assert env_file_values(note=lambda m: None) == {"Z": "2"}


def test_bad_deepspeed_env_line_names_file_and_line(places):
    home, _ = places
    (home / ".deepspeed_env").write_text("OK=1\nX=1; touch /tmp/p; Y=2\n")  # fine: X's value is literal
    assert env_file_values(note=lambda m: None) == {"OK": "1", "X": "1; touch /tmp/p; Y=2"}
    (home / ".deepspeed_env").write_text("OK=1\nBAD KEY=1\n")
    with pytest.raises(ZerorunError, match=rf"^{home / '.deepspeed_env'}:2: expected KEY=VALUE with a variable name"):
        env_file_values(note=lambda m: None)


@pytest.mark.slow
def test_ranks_get_deepspeed_env_values(places):
    home, here = places
    (home / ".deepspeed_env").write_text("FROM_DS=value with spaces; $(no) 'expansion'\n")
    (here / "s.py").write_text("import os\nprint('FROM_DS=' + os.environ['FROM_DS'])\n")
    out = subprocess.run([sys.executable, "-m", "zerorun", "launch", "--num-procs", "1", "--log-dir",
                          str(here / "runs"), "--no-dashboard", "s.py"], cwd=str(here), capture_output=True,
                         text=True, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stdout + out.stderr
    assert "FROM_DS=value with spaces; $(no) 'expansion'" in out.stdout
    assert f"zerorun: note: 1 variable(s) for the ranks from DeepSpeed's environment file {home / '.deepspeed_env'}" \
        in out.stderr


def test_forwarded_names_are_variable_names():
    """A launcher environment may hold any name; one that is not a variable name would reach the remote
    shell's export line unquoted, so it is not forwarded."""
    from zerorun.launch.env import allowed_env

    environ = {"NCCL_DEBUG": "INFO", "NCCL_X;touch /tmp/p;Y": "1", "TORCH_$(id)": "1", "HOME": "/root"}
    assert allowed_env(environ) == {"NCCL_DEBUG": "INFO"}
