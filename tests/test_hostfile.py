import pytest

from zerorun.errors import ZerorunError
from zerorun.hostfile import Host, parse_hostfile, read_hostfile


def test_parses_deepspeed_format_with_comments_and_blank_lines():
    text = "# cluster\n\nworker-1 slots=4\nworker-2   slots = 2  # the small one\n127.0.0.1 slots=1\n"
    assert parse_hostfile(text) == [Host("worker-1", 4), Host("worker-2", 2), Host("127.0.0.1", 1)]


@pytest.mark.parametrize("text,expected", [
    ("worker-1 slots=4\nworker-1 slots=2\n", r"hf:2: duplicate host 'worker-1' \(first on line 1\)"),
    ("worker-1 slots=0\n", r"hf:1: worker-1: slots must be a positive integer, got '0'"),
    ("worker-1 slots=-2\n", r"hf:1: worker-1: slots must be a positive integer"),
    ("worker-1 slots=two\n", r"hf:1: worker-1: slots must be a positive integer, got 'two'"),
    ("worker-1 slots=1.5\n", r"hf:1: worker-1: slots must be a positive integer"),
    ("\nworker-1\n", r"hf:2: worker-1: missing slots=N"),
    ("worker 1 slots=2\n", r"hf:1: malformed line 'worker 1 slots=2'"),
    ("worker-1 gpus=2\n", r"hf:1: malformed line"),
    ("# nothing\n\n", r"hf: no hosts"),
])
def test_bad_hostfiles_name_the_line(text, expected):
    with pytest.raises(ZerorunError, match=expected) as info:
        parse_hostfile(text, "hf")
    assert info.value.exit_code == 2


def test_missing_hostfile(tmp_path):
    with pytest.raises(ZerorunError, match=r"cannot read hostfile"):
        read_hostfile(str(tmp_path / "none"))


def test_local_hosts():
    assert Host("localhost", 1).is_local and Host("127.0.0.1", 1).is_local
    assert not Host("127.0.0.2", 1).is_local and not Host("worker-9", 1).is_local


def test_not_utf8_hostfile(tmp_path):
    (tmp_path / "h").write_bytes(b"\xff\xfe slots=2\n")
    with pytest.raises(ZerorunError, match=r"cannot read hostfile: not UTF-8 text"):
        read_hostfile(str(tmp_path / "h"))
