"""The typer app: every ``zerorun`` command registered under its name, in the order ``zerorun -h`` lists them."""

from __future__ import annotations

from typing import Callable, NamedTuple

import typer

from zerorun.cli.batch import attach, submit
from zerorun.cli.jobs import launch, train
from zerorun.cli.tools import bench, consolidate, env_report, estimate, import_deepspeed, show

_NO_EXTRA = {"allow_extra_args": False}


class Command(NamedTuple):
    """One command: its function, its name on the command line, its page under docs/, an example command line
    (shown by its -h, at most 69 characters: one line at 80 columns; tests/test_cli_help.py parses it) and
    click's context settings for it."""

    run: Callable[..., None]
    name: str
    page: str
    example: str
    settings: dict | None = None


COMMANDS = (
    Command(env_report, "env", "troubleshooting.md", "zerorun env -H hostfile"),
    Command(train, "train", "launching.md", "zerorun train recipes/gpt-stdlib.yaml -H hostfile zero.stage=3",
            _NO_EXTRA),
    Command(submit, "submit", "launching.md", "zerorun submit recipes/tiny.yaml --nodes 2 --time 01:00:00", _NO_EXTRA),
    Command(attach, "attach", "launching.md", "zerorun attach 1234"),
    Command(consolidate, "consolidate", "checkpoints.md",
            "zerorun consolidate runs/tiny/checkpoints --out model.safetensors"),
    Command(import_deepspeed, "import-deepspeed", "from-deepspeed.md",
            "zerorun import-deepspeed ds_config.json -H hostfile > recipe.yaml"),
    # options after the script are the script's
    Command(launch, "launch", "launching.md", "zerorun launch --nproc-per-node 2 -m mypkg.train --lr 3e-4",
            {"allow_extra_args": True, "allow_interspersed_args": False}),
    Command(bench, "bench", "benchmarks.md", "zerorun bench recipes/tiny.yaml --stages 0,2,3 --baseline ddp,fsdp2",
            _NO_EXTRA),
    Command(estimate, "estimate", "zero-stages.md", "zerorun estimate recipes/gpt-stdlib.yaml -H hostfile",
            _NO_EXTRA),
    Command(show, "show", "dashboard.md", "zerorun show runs/gpt-stdlib --plot loss.png"),
)


def epilog(example: str, page: str) -> str:
    """The end of a command's -h: its example and its docs page, each on a line of its own (click's ``\\b``
    keeps them from being rewrapped)."""
    return f"\b\nExample: {example}\nDocs: docs/{page}"


# Note [Plain help]: click's own help layout, not typer's rich panels. The panels cut option names that do not
# fit their column ('--master-port,--maste…' in `zerorun launch -h` at 80 columns) and show '<bool>' after every
# flag; click's layout puts a long option name on a line of its own and gives flags no metavar, as argparse
# (torchrun, accelerate, deepspeed) does.
app = typer.Typer(add_completion=True, no_args_is_help=True, pretty_exceptions_enable=False, rich_markup_mode=None,
                  context_settings={"help_option_names": ["-h", "--help"]},
                  help="zerorun: launch and run ZeRO data-parallel training jobs.",
                  epilog=epilog("zerorun train recipes/gpt-stdlib.yaml", "index.md"))


def _version(value: bool) -> None:
    if value:
        import zerorun

        print(f"zerorun {zerorun.__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print zerorun's version and exit.")) -> None:
    """zerorun: launch and run ZeRO data-parallel training jobs."""


for _command in COMMANDS:
    app.command(_command.name, context_settings=_command.settings,
                epilog=epilog(_command.example, _command.page))(_command.run)
