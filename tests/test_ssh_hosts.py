"""How remote hosts are reached, through a real sshd on loopback (tests/sshd.py): host keys checked as OpenSSH
checks them (known_hosts, StrictHostKeyChecking), ConnectTimeout from the SSH config, ProxyJump."""

from __future__ import annotations

import getpass
import os
import socket
import subprocess
import sys
import time

import pytest

from sshd import SSHD, LoopbackSshd

pytestmark = [pytest.mark.slow, pytest.mark.ssh,
              pytest.mark.skipif(not os.path.exists(SSHD), reason="openssh-server is not installed (.ci/run "
                                                                  "installs it)")]


def host_key_line(sshd: LoopbackSshd, address: str, pub: str) -> str:
    """A known_hosts line for ``address`` on the server's port with the public key in file ``pub``."""
    with open(pub) as f:
        kind, key = f.read().split()[:2]
    return f"[{address}]:{sshd.port} {kind} {key}\n"


def write_config(path, sshd: LoopbackSshd, strict: str, known_hosts: str, extra: str = "") -> str:
    path.write_text(f"Host 127.0.0.2 127.0.0.3\n  Port {sshd.port}\n  User {getpass.getuser()}\n"
                    f"  IdentityFile {sshd.key}\n  StrictHostKeyChecking {strict}\n"
                    f"  UserKnownHostsFile {known_hosts}\n  GlobalKnownHostsFile /dev/null\n{extra}")
    return str(path)


def launch(tmp_path, config: str, hosts: str, timeout: float = 120) -> subprocess.CompletedProcess:
    (tmp_path / "s.py").write_text("import pathlib, os\npathlib.Path('ran-' + os.environ['RANK']).touch()\n")
    (tmp_path / "hosts").write_text(hosts)
    return subprocess.run([sys.executable, "-m", "zerorun", "launch", "-H", str(tmp_path / "hosts"),
                           "--ssh-config", config, "--no-dashboard", "--log-dir", str(tmp_path / "runs"), "s.py"],
                          cwd=str(tmp_path), capture_output=True, text=True, timeout=timeout)


def test_changed_host_key_is_refused_and_nothing_runs(sshd, tmp_path):
    other = tmp_path / "other_host_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
    known = tmp_path / "known_hosts"
    known.write_text(host_key_line(sshd, "127.0.0.2", str(other) + ".pub"))
    config = write_config(tmp_path / "config", sshd, "yes", str(known))
    out = launch(tmp_path, config, "127.0.0.2 slots=1\n")
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr.startswith("zerorun: error: preflight: 127.0.0.2: REMOTE HOST IDENTIFICATION HAS CHANGED: "
                                 "the host key of 127.0.0.2 is ssh-ed25519 "), out.stderr
    assert "Host key verification failed" in out.stderr and len(out.stderr.splitlines()) == 1
    assert not list(tmp_path.glob("ran-*"))


def test_strict_host_key_checking_settings(sshd, tmp_path):
    from zerorun.launch.preflight import describe_connect_error
    from zerorun.launch.remote import SshOptions, connect

    known = tmp_path / "known_hosts"
    for strict in ("yes", "ask"):  # ask: there is no prompt, so it refuses
        opts = SshOptions(config=write_config(tmp_path / f"config-{strict}", sshd, strict, str(known)))
        with pytest.raises(Exception) as e:
            connect("127.0.0.2", opts)
        line = describe_connect_error(e.value, "127.0.0.2", opts)
        assert line.startswith("host key refused: no host key is known for [127.0.0.2]:") and \
            f"StrictHostKeyChecking is {strict}" in line, line
    assert not known.exists()
    # accept-new: the first connection adds the key; then `yes` accepts it
    connect("127.0.0.2", SshOptions(config=write_config(tmp_path / "c-new", sshd, "accept-new", str(known)))).close()
    assert known.read_text().split()[1:] == host_key_line(sshd, "127.0.0.2", sshd.folder + "/host_key.pub").split()[1:]
    connect("127.0.0.2", SshOptions(config=write_config(tmp_path / "c-yes", sshd, "yes", str(known)))).close()
    # no: an unknown key goes (lines that do not parse are skipped)
    (tmp_path / "bad").write_text("garbage line\n")
    connect("127.0.0.2", SshOptions(config=write_config(tmp_path / "c-no", sshd, "no", str(tmp_path / "bad")))).close()


def test_changed_or_revoked_key_is_refused_under_strict_host_key_checking_no(sshd, tmp_path):
    """`StrictHostKeyChecking no` accepts unknown keys only: a key that differs from the known one, or one
    marked @revoked, is refused (OpenSSH warns and goes on for a changed key: zerorun is stricter)."""
    from zerorun.launch.preflight import describe_connect_error
    from zerorun.launch.remote import SshOptions, connect

    other = tmp_path / "other_host_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
    known = tmp_path / "known_hosts"
    good = host_key_line(sshd, "127.0.0.2", sshd.folder + "/host_key.pub")
    kind, key = good.split()[1:3]
    for text, expected in ((host_key_line(sshd, "127.0.0.2", str(other) + ".pub"), "REMOTE HOST IDENTIFICATION "
                            "HAS CHANGED"), (f"{good}@revoked * {kind} {key}\n", "is marked @revoked")):
        known.write_text(text)
        opts = SshOptions(config=write_config(tmp_path / "c-no", sshd, "no", str(known)))
        with pytest.raises(Exception) as e:
            connect("127.0.0.2", opts)
        line = describe_connect_error(e.value, "127.0.0.2", opts)
        assert expected in line and "127.0.0.2" in line and "\n" not in line, line
    known.write_text("")  # unknown: accepted, the file left as it was
    connect("127.0.0.2", SshOptions(config=write_config(tmp_path / "c-no", sshd, "no", str(known)))).close()
    assert known.read_text() == ""


def test_known_hosts_with_cert_authority_revoked_and_comment_lines(sshd, tmp_path):
    """OpenSSH's known_hosts also holds `@cert-authority` and `@revoked` lines and comments: a host with a plain
    key line is reached past them, a revoked key is refused (even listed as known), and accept-new appends one
    line without rewriting the file."""
    from zerorun.launch.preflight import describe_connect_error
    from zerorun.launch.remote import SshOptions, connect

    ca = tmp_path / "ca"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(ca)], check=True)
    kind, ca_key = (tmp_path / "ca.pub").read_text().split()[:2]
    good = host_key_line(sshd, "127.0.0.2", sshd.folder + "/host_key.pub")
    known = tmp_path / "known_hosts"
    text = f"# my hosts\n@cert-authority *.example.org {kind} {ca_key}\n{good}"
    known.write_text(text)
    connect("127.0.0.2", SshOptions(config=write_config(tmp_path / "c-yes", sshd, "yes", str(known)))).close()
    connect("127.0.0.3", SshOptions(config=write_config(tmp_path / "c-new", sshd, "accept-new", str(known)))).close()
    after = known.read_text()
    assert after.startswith(text) and after[len(text):].split()[1:] == good.split()[1:], after
    server_kind, server_key = good.split()[1:3]
    known.write_text(f"{good}@revoked * {server_kind} {server_key}\n")
    for strict in ("yes", "accept-new"):
        opts = SshOptions(config=write_config(tmp_path / f"c-rev-{strict}", sshd, strict, str(known)))
        with pytest.raises(Exception) as e:
            connect("127.0.0.2", opts)
        line = describe_connect_error(e.value, "127.0.0.2", opts)
        assert "is marked @revoked" in line and "127.0.0.2" in line and "\n" not in line, line


def test_connect_timeout_from_ssh_config_and_proxy_jump(sshd, tmp_path):
    """A host that accepts TCP but never speaks SSH fails after the config's ConnectTimeout (not a fixed 10 s),
    named; a host behind ProxyJump is reached through the jump host (and a jump host that is down is named)."""
    known = tmp_path / "known_hosts"
    known.write_text(host_key_line(sshd, "127.0.0.2", sshd.folder + "/host_key.pub") +
                     host_key_line(sshd, "127.0.0.3", sshd.folder + "/host_key.pub"))
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        extra = (f"Host silent\n  HostName 127.0.0.1\n  Port {silent.getsockname()[1]}\n  ConnectTimeout 2\n"
                 f"Host behind\n  HostName 127.0.0.3\n  Port {sshd.port}\n  User {getpass.getuser()}\n"
                 f"  IdentityFile {sshd.key}\n  ProxyJump 127.0.0.2\n  UserKnownHostsFile {known}\n"
                 f"Host behind-down\n  HostName 127.0.0.3\n  Port {sshd.port}\n  ProxyJump silent\n")
        config = write_config(tmp_path / "config", sshd, "yes", str(known), extra)
        t0 = time.time()
        out = launch(tmp_path, config, "silent slots=1\nbehind-down slots=1\n")
        took = time.time() - t0
    assert out.returncode == 2 and sorted(out.stderr.splitlines()) == [
        "zerorun: error: preflight: behind-down: jump host silent: unreachable: no answer within 2 s (ConnectTimeout)",
        "zerorun: error: preflight: silent: unreachable: no answer within 2 s (ConnectTimeout)"], out.stderr
    assert took < 9, took
    out = launch(tmp_path, config, "behind slots=1\n127.0.0.2 slots=1\n")
    assert out.returncode == 0, out.stdout + out.stderr
    assert sorted(p.name for p in tmp_path.glob("ran-*")) == ["ran-0", "ran-1"]
    from zerorun.launch.remote import SshOptions, connect

    conn = connect("behind", SshOptions(config=config))  # the jump host's session carries the connection
    assert conn.gateway.original_host == "127.0.0.2" and conn.gateway.transport.is_authenticated()
    conn.close()
