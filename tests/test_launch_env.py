"""What crosses to remote nodes (launch/env.py) and how it is quoted (launch/remote.py), without SSH."""

import subprocess

import pytest

from zerorun.errors import ZerorunError
from zerorun.launch.env import allowed_env, env_file_values, parse_env_file
from zerorun.launch.job import master_address
from zerorun.recipe.hostfile import Host
from zerorun.launch.remote import shell_script


def test_allowlisted_prefixes_only():
    environ = {"NCCL_DEBUG": "INFO", "PYTHONPATH": "/x", "CUDA_VISIBLE_DEVICES": "0,1", "GLOO_SOCKET_IFNAME": "lo",
               "TORCH_LOGS": "+dynamo", "OMP_NUM_THREADS": "4", "AWS_SECRET_ACCESS_KEY": "s", "HOME": "/root",
               "PATH": "/bin", "MY_NCCL_THING": "x"}
    assert allowed_env(environ) == {k: environ[k] for k in ("NCCL_DEBUG", "PYTHONPATH", "CUDA_VISIBLE_DEVICES",
                                                           "GLOO_SOCKET_IFNAME", "TORCH_LOGS", "OMP_NUM_THREADS")}


def test_env_file_lines_are_literal(tmp_path):
    text = "# comment\n\n  # indented comment\nA=1\nexport B = two words \nC=x=y 'q' \"$HOME\"\nD=\n"
    assert parse_env_file(text) == {"A": "1", "B": " two words ", "C": "x=y 'q' \"$HOME\"", "D": ""}
    home, here = tmp_path / "home", tmp_path / "here"
    home.mkdir(), here.mkdir()
    (home / ".zerorun_env").write_text("A=home\nB=home\n")
    (here / ".zerorun_env").write_text("B=here\n")
    assert env_file_values([str(home / ".zerorun_env"), str(here / ".zerorun_env"), str(tmp_path / "none")]) == \
        {"A": "home", "B": "here"}


@pytest.mark.parametrize("text,expected", [
    ("A=1\nno equals here\n", r"^f:2: expected KEY=VALUE with a variable name, got 'no equals here'$"),
    ("1BAD=x\n", r"^f:1: expected KEY=VALUE"),
])
def test_bad_env_file_names_the_line(text, expected):
    with pytest.raises(ZerorunError, match=expected):
        parse_env_file(text, "f")


def test_shell_script_values_arrive_byte_for_byte(tmp_path):
    values = {"A": "two words", "B": "it's \"q\" \\", "C": "$HOME;echo pwned `id` | x & y > z",
              "D": "line1\nline2\n", "E": "", "F": "ünïcode ✓"}
    argv = ["python3", "-c", "import os, sys, json; print(json.dumps({k: os.environ[k] for k in sys.argv[1:]}))",
            *values]
    script = shell_script(argv, values, str(tmp_path))
    out = subprocess.run(["sh", "-s"], input=script.encode(), capture_output=True, check=True)
    import json

    assert json.loads(out.stdout) == values
    assert not (tmp_path / "z").exists()


class FakeConn:
    def __init__(self, host, local="10.0.0.5"):
        self.host = host
        self.transport = type("T", (), {"sock": type("S", (), {"getsockname": lambda s: (local, 22)})()})()


def test_master_address_is_reachable_from_the_other_nodes():
    # a remote first host: its SSH HostName
    assert master_address([Host("alias", 1), Host("b", 1)], {"alias": FakeConn("10.0.0.7"), "b": FakeConn("b")}) \
        == "10.0.0.7"
    # this machine first, other nodes elsewhere: our end of the route to them, not 127.0.0.1
    assert master_address([Host("localhost", 1), Host("b", 1)], {"b": FakeConn("10.0.0.9")}) == "10.0.0.5"
    # everything on loopback
    assert master_address([Host("localhost", 1), Host("127.0.0.2", 1)], {"127.0.0.2": FakeConn("127.0.0.2")}) \
        == "127.0.0.1"
    assert master_address([Host("127.0.0.2", 1), Host("127.0.0.3", 1)],
                          {"127.0.0.2": FakeConn("127.0.0.2"), "127.0.0.3": FakeConn("127.0.0.3")}) == "127.0.0.2"
    # a first host on this machine reached over SSH (--ssh-local), others elsewhere
    assert master_address([Host("localhost", 1), Host("b", 1)],
                          {"localhost": FakeConn("localhost"), "b": FakeConn("10.0.0.9")}) == "10.0.0.5"


def test_names_with_a_final_newline_are_not_names():
    """``$`` matches before a final newline: ``NCCL_X\\n`` from the launcher's environment must not pass."""
    assert allowed_env({"NCCL_X\n": "=/x.sh", "NCCL_OK": "1"}) == {"NCCL_OK": "1"}


def test_env_file_value_with_a_nul_byte_is_refused_at_load():
    with pytest.raises(ZerorunError, match=r"^f:2: X: the value holds a NUL byte, which no environment variable "
                                           r"can carry$"):
        parse_env_file("A=1\nX=a\0b\n", "f")


def test_env_strings_above_linux_limit_are_refused_at_load(tmp_path):
    """A ``KEY=VALUE`` above MAX_ARG_STRLEN made torchrun's exec fail with "Argument list too long" (exit 127):
    the file and line are named at load instead. The limit is Linux's own: one byte less still starts."""
    import os
    from zerorun.recipe.text import MAX_ENV_STRING

    fits = "x" * (MAX_ENV_STRING - len("BIG=") - 1)
    assert subprocess.run(["true"], env={"BIG": fits}).returncode == 0
    with pytest.raises(OSError, match="Argument list too long"):
        subprocess.run(["true"], env={"BIG": fits + "x"})
    assert parse_env_file(f"BIG={fits}\n", "f") == {"BIG": fits}
    with pytest.raises(ZerorunError, match=rf"^f:2: BIG: KEY=VALUE is {MAX_ENV_STRING + 1} bytes, above Linux's "
                                           rf"limit of {MAX_ENV_STRING} bytes .*could not start$") as info:
        parse_env_file(f"A=1\nBIG={fits}x\n", "f")
    assert info.value.exit_code == 2
    path = tmp_path / ".deepspeed_env"
    path.write_text(f"BIG={fits}é\n")
    with pytest.raises(ZerorunError, match=rf"^{path}:1: BIG: KEY=VALUE is {MAX_ENV_STRING + 2} bytes"):
        env_file_values([str(path)], note=lambda m: None)
    assert os.path.exists(path)
