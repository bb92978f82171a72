"""The launcher's model check: build the recipe's model on the meta device in a child process, beside the launch.

Note [Model check beside the launch]: importing torch and the user's module takes seconds, so the check no
longer runs before the ranks start (it made every job wait for it, and the launcher print nothing meanwhile).
:func:`start` starts it in a child process (the ranks' interpreter and working directory, so the user's
module-level code runs outside the launcher) at the moment the launch begins; the supervisor polls it
(:meth:`ModelCheck.problem`) and, if it finds a problem before the ranks do, stops the job and reports the
check's one line with exit status 2. A model that is fine costs the job nothing but the child's CPU time,
which it spends mostly while torchrun's agent imports torch on another core; the child runs at the lowest
priority (``nice 19``): it gets a CPU where the ranks leave one idle, and hardly any where they do not. The
ranks build the model themselves too, so a problem the check cannot see is still reported by them. When a rank
crashes (exit status 1) while the check still runs (a busy machine starves it), or in the same moment as it
ends (the supervisor sees the crash first), the launcher waits for the check, the CPUs free now, and reports
what it finds instead (``launch.run.prefer_check``): an unknown optimizer argument makes the ranks
raise a TypeError, but its cause is the recipe's field.

What the check reports (one line each): the recipe's optimizer (``train.optimizer``: not in ``torch.optim``,
not elementwise, an argument it does not take: checked here because it needs torch, which the launcher does not
import), a missing or broken model module, a missing factory, ``model.kwargs`` the factory does not take, a
factory that returns no module, ``zero.units`` naming no class of the model. Anything else it meets (a
factory that cannot run on the meta device, a module that exits on import) is left to the ranks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

#: the prefix of the child's one error line on stderr.
PREFIX = "zerorun-check: error: "


class ModelCheck:
    """A running model check (:func:`start`). :meth:`problem` polls it; :meth:`wait` waits; :meth:`stop` ends
    it (only this check's own child process, by its handle)."""

    def __init__(self, proc: subprocess.Popen | None, stderr=None) -> None:
        self.proc, self.stderr = proc, stderr
        self._result: str | None = None
        self._done = proc is None

    def problem(self) -> str | None:
        """The check's one-line error once it has found one, else None (still running, or the model is fine,
        or the check itself could not run: then the ranks report what is wrong)."""
        if not self._done and self.proc.poll() is not None:
            self._collect()
        return self._result

    @property
    def done(self) -> bool:
        """True once the child has ended (or never started)."""
        if not self._done and self.proc.poll() is not None:
            self._collect()
        return self._done

    def wait(self, timeout: float = 300.0) -> str | None:
        """Wait up to ``timeout`` seconds for the check; return its error line or None."""
        if not self._done:
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.stop()
                return None
            self._collect()
        return self._result

    def _collect(self) -> None:
        self.proc.wait()
        self.stderr.seek(0)
        err = self.stderr.read().decode("utf-8", "replace")
        self.stderr.close()
        last = err.strip().splitlines()[-1] if err.strip() else ""
        if self.proc.returncode == 2 and last.startswith(PREFIX):
            self._result = last[len(PREFIX):]
        self._done = True

    def stop(self) -> None:
        """End the child if it still runs."""
        if not self._done:
            self.proc.kill()
            self.proc.wait()
            self.stderr.close()
            self._done = True


def start(recipe, path: str, overrides: list[str], *, model: bool = True, beside: bool = True) -> ModelCheck:
    """Start checking ``recipe`` (loaded from ``path`` with ``overrides``) in a child process; return at once.

    The child loads the recipe again with every check (the optimizer's needs torch), in this process's working
    directory so that the error names the same file, line or override, then builds the model on the meta device
    in ``launch.workdir`` (not with ``model=False``: the optimizer only). ``beside``: it runs beside the ranks,
    at the lowest priority (else it is waited for, at normal priority). A child that cannot start makes a
    check that finds nothing.
    """
    ask = json.dumps({"model": model, "path": os.path.abspath(path), "overrides": list(overrides), "cwd": os.getcwd(),
                      "workdir": recipe.launch.workdir, "recipe": json.loads(recipe.model_dump_json())})
    stderr = tempfile.TemporaryFile()  # not a pipe: a child that writes much must never block on it

    def preexec() -> None:  # the check ends with the launcher, even a SIGKILLed one (a hung import would not)
        import ctypes
        import signal

        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG, prctl(2): Linux
        except AttributeError:
            pass
        if beside:
            os.nice(19)

    try:
        proc = subprocess.Popen([recipe.launch.python or sys.executable, "-m", "zerorun.rank.modelcheck"],
                                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=stderr, text=True,
                                preexec_fn=preexec)
        proc.stdin.write(ask)
        proc.stdin.close()
    except OSError:
        stderr.close()
        return ModelCheck(None)
    return ModelCheck(proc, stderr)


def main() -> None:
    """The child of :func:`start`: exit 2 with one ``zerorun-check: error:`` line on stderr when the recipe's
    optimizer or model cannot be what it says, else exit 0."""
    ask = json.loads(sys.stdin.read())
    from zerorun.errors import ZerorunError
    from zerorun.estimate import layout_of_recipe
    from zerorun.recipe import Recipe, load_recipe
    from zerorun.rank.userload import FactoryError

    try:
        os.chdir(ask["cwd"])
        load_recipe(ask["path"], ask["overrides"])  # the optimizer check, named as the launcher names fields
        if not ask.get("model", True):
            return
        recipe = Recipe.model_validate(ask["recipe"])
        if ask.get("workdir"):
            os.chdir(ask["workdir"])
        layout_of_recipe(recipe)
    except FactoryError as e:
        # a wrong argument (model.kwargs), not the meta device; a factory that exits (sys.exit, argparse) does so
        # on every rank too
        if isinstance(e.__cause__, (TypeError, SystemExit)):
            sys.stderr.write(f"{PREFIX}{e}\n")
            sys.exit(2)
    except ZerorunError as e:
        sys.stderr.write(f"{PREFIX}{e}\n")
        sys.exit(2)
    except OSError:
        pass


if __name__ == "__main__":
    main()
