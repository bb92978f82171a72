"""Every command's -h as a new user reads it (issue 36): an example line that parses and the docs page it is
explained on, no '<bool>' after a flag, option names whole at 80 columns, shell completion, and an unknown
option that names a recipe field answered with its override. In-process and torch-free: fast."""

from __future__ import annotations

import os
import re
import shlex
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "recipes/tiny.yaml")

#: each command's docs page (the issue's table; the pages are docs/<page>)
DOCS = {"train": "launching.md", "launch": "launching.md", "submit": "launching.md", "attach": "launching.md",
        "estimate": "zero-stages.md", "bench": "benchmarks.md", "show": "dashboard.md",
        "consolidate": "checkpoints.md", "import-deepspeed": "from-deepspeed.md", "env": "troubleshooting.md"}


def cli(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    """``zerorun ARGS`` through the console entry point at 80 columns: (exit code, stdout, stderr)."""
    from zerorun.cli import main

    monkeypatch.setattr(sys, "argv", ["zerorun", *args])
    monkeypatch.setenv("COLUMNS", "80")
    try:
        main()
        code = 0
    except SystemExit as e:
        code = e.code or 0
    out = capsys.readouterr()
    return code, out.out, out.err


def click_commands() -> dict:
    import typer

    from zerorun.cli import app

    return typer.main.get_command(app).commands


def test_the_docs_table_names_every_command():
    assert sorted(click_commands()) == sorted(DOCS)


@pytest.mark.parametrize("name", sorted(DOCS))
def test_help_has_an_example_that_parses_and_its_docs_page(monkeypatch, capsys, name):
    code, out, err = cli(monkeypatch, capsys, name, "-h")
    assert code == 0 and err == "", err
    assert re.search(rf"^\s*Docs: docs/{re.escape(DOCS[name])}$", out, re.M), out
    example = re.search(rf"^\s*Example: (zerorun {re.escape(name)} .*)$", out, re.M)
    assert example, out
    words = shlex.split(example.group(1))
    words = words[:words.index(">")] if ">" in words else words  # a shell redirection is not an argument
    command = click_commands()[name]
    command.make_context(name, words[2:])  # raises on an option or argument the command does not take


def test_the_top_help_names_the_docs_index_and_completion(monkeypatch, capsys):
    code, out, err = cli(monkeypatch, capsys, "-h")
    assert code == 0 and err == "", err
    assert re.search(r"^\s*Docs: docs/index\.md$", out, re.M) and re.search(r"^\s*Example: zerorun train ", out, re.M)
    assert "--install-completion" in out and "--show-completion" in out, out
    # typer 0.29 under click 8.5 takes --show-completion as a flag and asks shellingham for the shell from the
    # process tree, which finds none when no shell is among the test's parents (a detached job): say it is bash
    import shellingham

    monkeypatch.setattr(shellingham, "detect_shell", lambda *a, **k: ("bash", "/bin/bash"))
    code, out, err = cli(monkeypatch, capsys, "--show-completion", "bash")
    assert code == 0 and "_ZERORUN_COMPLETE=complete_bash" in out, out + err
    assert re.search(r"^complete .* zerorun$", out, re.M), out  # the command users type, also from python -m


@pytest.mark.parametrize("name", ["", *sorted(DOCS)])
def test_help_shows_no_bool_metavar(monkeypatch, capsys, name):
    """typer's rich panels showed '<bool>' after every flag (``--dry-run <bool>``)."""
    code, out, err = cli(monkeypatch, capsys, *[name] * bool(name), "-h")
    assert code == 0 and err == "", err
    assert "<bool>" not in out, out


@pytest.mark.parametrize("name", ["", *sorted(DOCS)])
def test_help_at_80_columns_shows_every_option_name_whole(monkeypatch, capsys, name):
    """``zerorun launch -h`` at 80 columns cut '--master-port,--maste…' (rich's panel column)."""
    import typer

    from zerorun.cli import app

    code, out, err = cli(monkeypatch, capsys, *[name] * bool(name), "-h")
    assert code == 0 and err == "", err
    command = click_commands()[name] if name else typer.main.get_command(app)
    names = [o for p in command.params if p.param_type_name == "option" for o in (*p.opts, *p.secondary_opts)]
    assert names
    for option in names:
        assert re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", out), (option, out)
    assert max(map(len, out.splitlines())) <= 80, out


@pytest.mark.parametrize("args,override", [
    (["train", TINY, "--steps", "10"], "train.steps=10"),
    (["train", TINY, "--stage=3"], "zero.stage=3"),
    (["train", TINY, "--micro-batch-size", "4"], "train.micro_batch_size=4"),
    (["train", TINY, "--zero.bucket-mb", "50"], "zero.bucket_mb=50"),  # a dotted path
    (["train", TINY, "--activation-checkpointing"], "train.activation_checkpointing=true"),  # a bool as a flag
    (["train", TINY, "--lr", "-1e-3"], "train.optimizer.lr=-1e-3"),
    (["train", TINY, "--dir", "out"], "checkpoint.dir=out or log.dir=out"),  # every field of that name
    (["estimate", "--params", "7B", "--stage", "3"], "zero.stage=3"),
    (["submit", TINY, "--steps", "10"], "train.steps=10"),  # not "an sbatch option goes after '--'"
    (["bench", TINY, "--stage", "3"], "(did you mean --stages?); recipe fields are set by overrides: zero.stage=3"),
])
def test_an_option_that_names_a_recipe_field_suggests_its_override(monkeypatch, capsys, args, override):
    code, out, err = cli(monkeypatch, capsys, *args)
    assert code == 2 and out == "" and len(err.splitlines()) == 1, err
    option = next(a for a in args[1:] if a.startswith("--") and a != "--params").split("=")[0]
    assert err.startswith(f"zerorun: error: No such option: {option}"), err
    assert override in err, err


@pytest.mark.parametrize("args,expected", [
    (["launch", "--steps", "3", "s.py"], "No such option: --steps (Possible options"),  # no recipe: no override
    (["train", TINY, "--bogus"], "No such option: --bogus (see '"),
    (["submit", TINY, "--qos", "high"], "an sbatch option goes after '--', at the end"),
])
def test_an_unknown_option_that_is_no_recipe_field_keeps_its_line(monkeypatch, capsys, args, expected):
    code, out, err = cli(monkeypatch, capsys, *args)
    assert code == 2 and len(err.splitlines()) == 1 and expected in err and "overrides" not in err, err
