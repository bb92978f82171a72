"""The console entry point (``zerorun.cli:main``): the typer app run with zerorun's argument fix-ups, and every
failure as one ``zerorun: error:`` line with its exit code."""

from __future__ import annotations

import os
import sys

from zerorun.cli.app import app
from zerorun.errors import ZerorunError


def _err(message: str) -> None:
    sys.stderr.write("".join(f"zerorun: error: {line}\n" for line in message.splitlines() or [""]))
    sys.stderr.flush()


def optional_value(argv: list[str], option: str, default: str) -> list[str]:
    """``argv`` with ``option`` given ``default`` where it has no value of its own (typer options always take
    one): at the end, before another option, or before a ``FIELD=VALUE`` override that is not a path."""
    out = list(argv)
    for i, arg in enumerate(out):
        if arg == option:
            nxt = out[i + 1] if i + 1 < len(out) else None
            if nxt is None or nxt.startswith("-") or ("=" in nxt and not os.path.exists(nxt)):
                out[i] = f"{option}={default}"
    return out


def split_sbatch_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """``zerorun submit``'s arguments and, after its ``--``, the extra sbatch arguments (click would mix them
    into the overrides); other commands' ``argv`` unchanged, with no sbatch arguments."""
    if argv[:1] == ["submit"] and "--" in argv:
        cut = argv.index("--")
        return argv[:cut], argv[cut + 1:]
    return argv, []


def main() -> None:
    """Console entry point: run the typer app; a :class:`ZerorunError` becomes one line and its exit code."""
    try:
        argv, sbatch_args = split_sbatch_args(optional_value(sys.argv[1:], "--resume", "latest"))
        code = app(args=argv, standalone_mode=False, obj={"sbatch_args": sbatch_args})
        if isinstance(code, int) and code:  # typer.Exit(code): attach passes on the job's exit status
            sys.exit(code)
    except ZerorunError as e:
        _err(str(e))
        sys.exit(e.exit_code)
    except SystemExit:
        raise
    except KeyboardInterrupt:
        _err("interrupted")
        sys.exit(130)
    except Exception as e:  # click's (typer's) usage errors: one line, as every other bad input
        if type(e).__name__ == "NoArgsIsHelpError":  # a bare `zerorun`: the help was printed, nothing failed
            sys.exit(0)
        if type(e).__name__ == "NoSuchOption" and sys.argv[1:2] == ["submit"]:
            from zerorun.launch.slurm_submit import misplaced_option

            _err(misplaced_option(sys.argv[1:], e.option_name))
            sys.exit(2)
        if hasattr(e, "format_message") and hasattr(e, "exit_code"):
            ctx = getattr(e, "ctx", None)
            hint = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
            _err(" ".join(e.format_message().split()) + hint)
            sys.exit(e.exit_code)
        if type(e).__name__ == "Abort":
            _err("aborted")
            sys.exit(130)
        raise
