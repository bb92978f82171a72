import pytest

from zerorun.errors import ZerorunError
from zerorun.recipe.hostfile import Host, parse_hostfile, read_hostfile, select_hosts


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
    # ssh would take these for options (-oProxyCommand runs a command): refused, as OpenSSH refuses them
    ("-oProxyCommand slots=1\n", r"hf:1: host name '-oProxyCommand' starts with '-': ssh would take it for an option"),
    ("-oProxyCommand=touch${IFS}/tmp/x slots=1\n",
     r"hf:1: host name '-oProxyCommand=touch\$\{IFS\}/tmp/x' starts with '-': ssh would take it for an option"),
    ("worker-1 slots=1\n-p2222 slots=1\n", r"hf:2: host name '-p2222' starts with '-'"),
    ("- slots=1\n", r"hf:1: host name '-' starts with '-'"),
    # a name with YAML's colon was reached over SSH as 'localhost:' (found by review)
    ("localhost: slots=2\n", r"^hf:1: host name 'localhost:' ends with ':': write 'localhost slots=N'$"),
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


HOSTS = [Host("a", 2), Host("b", 4), Host("c", 1)]


@pytest.mark.parametrize("kwargs,expected", [
    ({"include": "b"}, [Host("b", 4)]),
    ({"include": "a@b:1,3"}, [Host("a", 2), Host("b", 2, (1, 3))]),
    ({"include": "c@a:1"}, [Host("a", 1, (1,)), Host("c", 1)]),  # hostfile order, not the flag's
    ({"exclude": "a"}, [Host("b", 4), Host("c", 1)]),
    ({"exclude": "b:0,2@c"}, [Host("a", 2), Host("b", 2, (1, 3))]),
    ({"num_nodes": 2}, [Host("a", 2), Host("b", 4)]),
    ({"num_procs": 1, "num_nodes": 2}, [Host("a", 1), Host("b", 1)]),
    ({"include": "b:1,2,3", "num_procs": 2}, [Host("b", 2, (1, 2))]),
])
def test_include_exclude_num_nodes_num_procs(kwargs, expected):
    assert select_hosts(HOSTS, **kwargs) == expected


@pytest.mark.parametrize("kwargs,expected", [
    ({"include": "a", "exclude": "b"}, r"^--include and --exclude are mutually exclusive"),
    ({"include": "a@x"}, r"^--include 'a@x': unknown host 'x' \(hosts: a, b, c\)$"),
    ({"exclude": "b:4"}, r"^--exclude 'b:4': b: unknown slot 4 \(it has slots 0\.\.3\)$"),
    ({"include": "b:one"}, r"^--include 'b:one': b: slot 'one' is not a slot index$"),
    ({"include": "@b"}, r"^--include '@b': empty host name"),
    ({"exclude": "a@b@c"}, r"^--exclude 'a@b@c': no host or slot is left$"),
    ({"num_nodes": 4}, r"^--num-nodes 4: only 3 host\(s\) selected$"),
    ({"num_procs": 3}, r"^--num-procs 3: host a has only 2 slot\(s\)$"),
])
def test_bad_selection_is_one_line(kwargs, expected):
    with pytest.raises(ZerorunError, match=expected):
        select_hosts(HOSTS, **kwargs)


def test_selected_slots_become_visible_devices():
    from zerorun.launch.plan import build_plan

    plan = build_plan(select_hosts(HOSTS, include="a@b:1,3"), "{}", "job", 1234)
    assert [n.env.get("CUDA_VISIBLE_DEVICES") for n in plan.nodes] == [None, "1,3"]
    assert [(n.first_rank, n.nproc) for n in plan.nodes] == [(0, 2), (2, 2)] and plan.world_size == 4
