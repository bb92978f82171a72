"""Loading the user's model and data modules (a ``.py`` file path or a dotted module name, and a factory), and
where in the user's code an error was raised (:func:`raised_at`)."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import inspect
import os
import sys
import traceback
from typing import Any

from zerorun.errors import ZerorunError


class UserCodeError(ZerorunError):
    """The user's module could not be imported, lacks the factory, the factory failed or returned the wrong
    thing, or the model's forward returned no loss. The message names the module and what is wrong."""


class FactoryError(UserCodeError):
    """The factory itself raised while building (as opposed to a missing module, factory or keyword)."""


def load_module(spec: str) -> Any:
    """Import ``spec``: a path to a ``.py`` file (its folder is put on ``sys.path`` for its own imports) or a
    dotted module name. A file is executed once per process, as ``import`` does (Note [One module per file]).

    Raises:
        UserCodeError: the file is missing or importing it raised (the exception type and message are given).
    """
    try:
        if spec.endswith(".py") or os.sep in spec:
            if not os.path.isfile(spec):
                raise UserCodeError(f"{spec}: file not found")
            folder = os.path.dirname(os.path.abspath(spec))
            if folder not in sys.path:
                sys.path.insert(0, folder)
            return _import_file(os.path.realpath(spec))
        return importlib.import_module(spec)
    except UserCodeError:
        raise
    except BaseException as e:  # noqa: BLE001 - user code may raise anything, SystemExit included
        raise UserCodeError(f"{spec}: cannot import: {type(e).__name__}: {e}") from e


# Note [One module per file]: ``model.module`` and ``data.module`` may name one file, and either may ``import`` the
# other by its name (its folder is on ``sys.path``). Each was executed again per load, as a module of its own: state
# the data factory set at module level was missing in the model's copy (a KeyError in forward), and classes of one
# copy were not those of the other (a review). A file is now one module per process: the one it became the first
# time (``zerorun_user_<name>``), which a later load returns; a file the user's code imported first is taken as it
# is; and the user's own ``import model`` that Python resolves to a file zerorun loaded gets that module
# (:class:`_LoadedFiles`, asked first for top-level names of such files only). Registering the file under its plain
# name instead gave a sibling folder's ``import net`` another folder's ``net.py`` (a review of that).
def _import_file(path: str) -> Any:
    """The module of the ``.py`` file at ``path`` (a real path), executed the first time only (again where the
    file changed since: a long-lived process, tests)."""
    stem = os.path.splitext(os.path.basename(path))[0]
    stamp = os.stat(path).st_mtime_ns
    known = _FILES.get(path, (None, None))
    if known[1] == stamp:
        return known[0]
    plain = sys.modules.get(stem)
    if known[0] is None and plain is not None and _file_of(plain) == path:  # the user's code imported it first
        _FILES[path] = (plain, stamp)
        return plain
    name = f"zerorun_user_{stem}" if known[0] is None else known[0].__name__
    while known[0] is None and name in sys.modules:  # another file of the same name
        name += "_"
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    _FILES[path] = (module, stamp)
    if not any(isinstance(f, _LoadedFiles) for f in sys.meta_path):  # after the built-in and frozen modules' finders
        path_finder = importlib.machinery.PathFinder  # on sys.meta_path as the class itself
        at = sys.meta_path.index(path_finder) if path_finder in sys.meta_path else len(sys.meta_path)
        sys.meta_path.insert(at, _LoadedFiles())
    return module


_FILES: dict[str, tuple[Any, int]] = {}  # real path -> (its module, the file's mtime then): Note [One module per file]


class _LoadedFiles(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Note [One module per file]: ``import NAME`` of a top-level name that Python's own path search resolves to
    a file :func:`_import_file` loaded gets that module, not a second execution of the file."""

    def find_spec(self, name, path=None, target=None):
        if path is not None or not any(os.path.basename(p)[:-3] == name for p in _FILES):
            return None  # a submodule, or no file of that name: Python's own finders, untouched
        found = importlib.machinery.PathFinder.find_spec(name)
        origin = os.path.realpath(found.origin) if found is not None and found.origin else None
        return importlib.util.spec_from_loader(name, self, origin=origin) if origin in _FILES else None

    handed: set[int] = set()  # modules create_module gave an import, executed once already

    def create_module(self, spec):
        module = _FILES[spec.origin][0]
        self.handed.add(id(module))
        return module

    def exec_module(self, module) -> None:
        if id(module) in self.handed:  # an import: the module as it is
            self.handed.discard(id(module))
        else:  # importlib.reload: the file's code again, in it (a review: reload returned it unchanged)
            importlib.machinery.SourceFileLoader(module.__name__, module.__spec__.origin).exec_module(module)


def _file_of(module: Any) -> str | None:
    file = getattr(module, "__file__", None)
    return os.path.realpath(file) if file else None


def call_factory(spec: str, factory: str, kwargs: dict[str, Any], module: Any = None,
                 field: str = "model.kwargs") -> Any:
    """``factory(**kwargs)`` from the module ``spec`` (see :func:`load_module`; ``module``: it, imported already),
    ``kwargs`` being the recipe's ``field``.

    Raises:
        UserCodeError: no such callable, or ``kwargs`` do not fit its signature.
        FactoryError: calling it raised.
    """
    module = module if module is not None else load_module(spec)
    fn = getattr(module, factory, None)
    if not callable(fn):
        import difflib

        near = difflib.get_close_matches(factory, [n for n, v in vars(module).items() if callable(v)
                                                   and not n.startswith("_")], n=1)
        raise UserCodeError(f"{spec}: has no callable {factory!r}" + (f" (did you mean {near[0]!r}?)" if near else ""))
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or C callable without a signature: let the call say
        signature = None
    if signature is not None:
        try:
            signature.bind(**kwargs)
        except TypeError as e:
            hint = " (YAML reads {a:1} as the key 'a:1': write {a: 1})" if any(
                v is None and ":" in str(k) for k, v in kwargs.items()) else ""
            raise UserCodeError(f"{spec}: {factory}() does not take {field} {kwargs}: {e}{hint}") from None
    try:
        return fn(**kwargs)
    except KeyboardInterrupt:
        raise  # Ctrl-C: the caller's "interrupted"
    except ZerorunError as e:
        if spec.startswith("zerorun."):  # zerorun's own factory (model.hf): its line as it is, as at stage 3
            raise
        raise FactoryError(f"{spec}: {factory}(**{kwargs}) raised {type(e).__name__}: {e}") from e
    except BaseException as e:  # noqa: BLE001 - sys.exit, argparse, GeneratorExit inside it: the same one line
        what = "the data" if field.startswith("data.") else "the model"
        hint = f" (a factory that parses the command line or exits cannot build {what} here)" if isinstance(
            e, SystemExit) else ""
        raise FactoryError(f"{spec}: {factory}(**{kwargs}) raised {type(e).__name__}: {e}{hint}") from e


def build_model(spec: str, factory: str, kwargs: dict[str, Any]):
    """The ``torch.nn.Module`` that ``factory(**kwargs)`` in ``spec`` builds.

    Raises:
        UserCodeError: as :func:`call_factory`, or the factory returned something that is not a module.
    """
    import torch

    model = call_factory(spec, factory, kwargs)
    if not isinstance(model, torch.nn.Module):
        raise UserCodeError(f"{spec}: {factory}() returned {type(model).__name__}, not a torch.nn.Module")
    if not any(p.requires_grad for p in model.parameters()):
        raise UserCodeError(f"{spec}: {factory}() built a model with no trainable parameters")
    return model


def extract_loss(output: Any, module: str):
    """The scalar loss tensor in a model's ``forward`` output: the tensor itself, ``output["loss"]`` or
    ``output.loss`` (the Hugging Face convention).

    Raises:
        UserCodeError: no loss found, the loss is not a scalar floating-point tensor, or with gradients on it
            needs none.
    """
    import torch

    loss = output
    if isinstance(output, dict):
        loss = output.get("loss")
    elif not isinstance(output, torch.Tensor):
        loss = getattr(output, "loss", None)
    if not isinstance(loss, torch.Tensor):
        raise UserCodeError(f"{module}: forward returned {type(output).__name__} with no loss: return the loss "
                            "tensor, or a dict/object with a 'loss' field")
    if loss.numel() != 1 or not loss.is_floating_point():
        raise UserCodeError(f"{module}: forward's loss must be a scalar floating-point tensor, got shape "
                            f"{tuple(loss.shape)} {loss.dtype}")
    if torch.is_grad_enabled() and not loss.requires_grad:  # torch's own error named neither file nor cause
        raise UserCodeError(f"{module}: forward's loss does not depend on any trainable parameter (it needs no "
                            "gradient): compute it from the model's outputs, not under torch.no_grad(), .detach(), "
                            ".item() or as a constant")
    return loss


def raised_at(e: BaseException) -> traceback.FrameSummary | None:
    """Where the one-line error says ``e`` was raised: the deepest frame outside torch, zerorun and Python's own
    library (the user's model or data code, or a library it calls, such as ``transformers``), else the deepest.
    A torch error in the user's forward is otherwise placed in torch's ``Linear.forward``, or at stage 3 in
    zerorun's parameter guard (``ZeroParameter.__torch_function__``), naming neither the user's file nor line."""
    frames = traceback.extract_tb(e.__traceback__)
    own = [f for f in frames if not below_the_user(f.filename)]
    return own[-1] if own else frames[-1] if frames else None


def below_the_user(path: str) -> bool:
    """Whether ``path`` is torch's, zerorun's or Python's own library (site-packages, which may lie inside the
    standard library's folder, is not: a library the user's code calls, such as ``transformers``)."""
    import sysconfig

    import zerorun

    path = os.path.abspath(path)
    packages = [sys.modules.get("torch"), zerorun]
    skip = tuple(os.path.dirname(m.__file__) + os.sep for m in packages if m is not None and m.__file__)
    paths = sysconfig.get_paths()
    # a venv's site-packages, and its base interpreter's (--system-site-packages: inside that one's stdlib folder,
    # which this venv's paths do not name: a new user's review), or Debian's dist-packages
    installed = {"site-packages", "dist-packages"} & set(path.split(os.sep))
    stdlib = {os.path.join(p, "") for p in (paths["stdlib"], sysconfig.get_paths(vars={"installed_base": sys.base_prefix,
                                                                                      "base": sys.base_prefix})["stdlib"])}
    return path.startswith(skip) or (path.startswith(tuple(stdlib)) and not installed)
