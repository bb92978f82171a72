"""The rank allocator (Note [Rank allocator]): which malloc each rank runs under, torch-free, so that the
launcher (the launch plan, each node's watcher, ``zerorun env``) and the rank (its start event) share it
without the launcher importing zero/. What only a rank does to glibc's malloc from inside (``mallopt``,
``malloc_trim``: Note [Returning freed memory]) is zero/allocator.py's. Imports nothing of zerorun at its top: a
rank imports it (through zero/allocator.py) before it allocates anything.

Note [Rank allocator]: zerorun's ranks run under gperftools' tcmalloc where their node has it (Debian/Ubuntu
package ``libtcmalloc-minimal4``; ``.ci/run`` installs it), else under Microsoft's mimalloc, whose shared library
comes with zerorun from pip (the ``cmeel-mimalloc`` wheel, a dependency: :func:`find_mimalloc`; issue 35: a fresh
install, where nobody ran apt-get, gets a fast allocator too; no wheel on PyPI ships tcmalloc or jemalloc), either
preloaded by each node's watcher (:func:`allocator_env`; ``ZERORUN_ALLOCATOR`` in the recipe's ``launch.env`` or
the launcher's environment may name ``tcmalloc``, ``mimalloc`` or ``glibc``), else under glibc with the tuning
of Note [Returning freed memory] (zero/allocator.py), where the watcher prints one line saying what to install
(:func:`fallback_note`). torch's own CPU launcher offers the same preload (``torch.backends.xeon.run_cpu
--enable-tcmalloc``).

Why: glibc tuned's fixed mmap threshold keeps what ZeRO frees off the peak, but every rank maps, faults in and
unmaps each large block on every use, stage 3 (which gathers and frees every unit twice a step) the most:
1.17x (stage 2) and 1.22x (stage 3) the CPU time of DDP as torchrun runs it. tcmalloc keeps freed spans in its
page heap and reuses them, so nothing is faulted in after the first step (0.92x, 0.84x), and its heap does not
grow with holes the way glibc's raised threshold does (realized saving 1.00 and 0.89 there; its peak moves by
a 32 MiB block between runs: docs/benchmarks.md, "The allocator").

mimalloc (v3, the only one the wheel ships) returns freed memory to the kernel 1 s after the free, shorter than a
step, which then faults it in again (stage 3 1.22x DDP's CPU time); never returning it runs at tcmalloc's speed but
holds 200-340 MiB more than tcmalloc at the peak (stages 0-3), what earlier phases freed in other sizes. So the
watcher gives mimalloc a purge delay no step outlasts (:data:`MIMALLOC_ENV`; the job's own value wins), and the engine
calls ``mi_collect(true)`` at the end of each step (zero/allocator.py's ``collect``; host-only, no device sync;
nothing under other allocators; the optimizer on disk included), and at stage 3 also before each backward: a step
reuses what it frees, and what it freed goes back to the kernel before the next; stage 3's forward frees every unit it
gathered, whose ranges, kept, did not serve backward's other sizes (its peak 1611 -> 1572 MiB, realized saving 0.72 ->
0.81 against tcmalloc's 0.86 in one run, for 2% more CPU time). Processes that run no zerorun engine (a script under
``zerorun launch``, the DDP and FSDP2 baselines of ``zerorun bench``) are never collected: under mimalloc they keep
what they free, as under tcmalloc. Measured before the backward collect (55M GPT, 2 gloo ranks, micro-batch 8;
docs/benchmarks.md, "What a fresh install runs", which has the run after it too), stages 1-3 then used 1.02x,
1.07-1.09x and 1.05-1.24x tcmalloc's CPU time on a loaded machine (0.99-1.02x on a lighter load: the kernel's time for
the faults) and held 1698, 1594 and 1555 MiB at their peak (tcmalloc 1576, 1471, 1382; kept 1865, 1668, 1581),
realized saving 1.06, 1.04 and 0.86 (tcmalloc 0.99, 0.99, 0.96), and 640-840 MiB less than kept between steps.
mimalloc's own options did not close the rest (benchmarks/results/history.md, "Issue 35: closing mimalloc's memory
gap"): without eager commit stage 3 holds 1476 MiB, but each step faults in 4 KiB pages (1.08-1.10x tcmalloc's CPU
time at every stage); decommitting at once, 1445 MiB at 1.47x. A job that needs the memory more than the speed asks
for ``ZERORUN_ALLOCATOR: glibc``.
"""

from __future__ import annotations

import os

#: Note [Returning freed memory] (zero/allocator.py): glibc's fixed mmap threshold for ranks (bytes).
MMAP_THRESHOLD = 1 << 20
#: the environment variables that ask for the same (a node without tcmalloc or mimalloc gives its ranks these).
GLIBC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD), "THP_MEM_ALLOC_ENABLE": "1"}

#: Note [Rank allocator]: the variable that chooses each rank's malloc, and the values it may take.
ALLOCATOR_VAR = "ZERORUN_ALLOCATOR"
ALLOCATORS = ("auto", "tcmalloc", "mimalloc", "glibc")
#: what a node without a fast allocator lacks (one line, printed where ``auto`` falls back to glibc tuned).
INSTALL_HINT = "pip install cmeel-mimalloc (a zerorun dependency), or apt-get install libtcmalloc-minimal4"


def allocator_problem(value: str) -> str | None:
    """Why ``value`` is not a value of ``ZERORUN_ALLOCATOR`` (Note [Rank allocator]), or None when it is."""
    if value in ALLOCATORS:
        return None
    return (f"ZERORUN_ALLOCATOR is {value!r}: expected auto (tcmalloc where the node has it, else mimalloc, else "
            "glibc tuned), tcmalloc, mimalloc or glibc")


#: allocators that replace glibc's malloc when preloaded: name -> the library's file name prefix.
PRELOADED = {"tcmalloc": "libtcmalloc", "jemalloc": "libjemalloc", "mimalloc": "libmimalloc"}


#: the pip distribution that brings mimalloc (a zerorun dependency: Note [Rank allocator]) and its library's name.
MIMALLOC_DIST, MIMALLOC_LIB = "cmeel-mimalloc", "libmimalloc.so"


def find_mimalloc() -> str | None:
    """The absolute path of the mimalloc shared library that pip installed beside zerorun (the
    ``cmeel-mimalloc`` wheel puts it in ``site-packages/cmeel.prefix/lib``), or None where it is missing."""
    from importlib import metadata

    try:
        files = metadata.distribution(MIMALLOC_DIST).files or []
    except metadata.PackageNotFoundError:
        return None
    libs = sorted((f for f in files if f.name.startswith(MIMALLOC_LIB)), key=lambda f: len(f.name))
    return next((str(f.locate()) for f in libs if os.path.isfile(f.locate())), None)


def _mapped() -> str:
    try:
        with open("/proc/self/maps") as f:
            return f.read()
    except OSError:
        return ""


def preloaded() -> bool:
    """Whether an allocator of :data:`PRELOADED` serves this process's malloc instead of glibc (Note [Rank
    allocator]: preloaded, so mapped)."""
    return name() != "glibc"


def name() -> str:
    """This process's malloc: one of :data:`PRELOADED`'s names when that library is mapped (Note [Rank
    allocator]: preloaded by zerorun or by the job), else ``"glibc"`` (also where /proc is missing)."""
    maps = _mapped()
    return next((n for n, lib in PRELOADED.items() if lib in maps), "glibc")


# ------------------------------------------------------------------------------------- the launcher's choice
# ZERORUN_ALLOCATOR chooses each rank's malloc (``auto``, the default: gperftools' tcmalloc where the node has it,
# else mimalloc from its pip wheel, a zerorun dependency, else glibc tuned; or one of them by name: ALLOCATORS). The
# launch plan gives every rank the launcher's choice (:func:`rank_env`); each node's watcher resolves it
# (:func:`allocator_env`). glibc's tuning (GLIBC_ENV, Note [Returning freed memory] in zero/allocator.py): a fixed
# mmap threshold, so freed tensors of 1 MiB or more go back to the OS instead of staying in the heap, and 2 MiB pages.
#: sonames of gperftools' tcmalloc, preferred first (Debian/Ubuntu: libtcmalloc-minimal4, libgoogle-perftools4).
TCMALLOC_SONAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
#: tcmalloc prints a line for every allocation above this many bytes (default 1 GiB): never, for a rank.
TCMALLOC_QUIET = {"TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": str(1 << 50)}
#: mimalloc returns what a rank frees to the kernel once per step, when the engine's optimizer has stepped
#: (``mi_collect``: zero/allocator.py's ``collect``), not after its default 1 s purge delay (shorter than a step:
#: the step faulted its memory in again several times) nor never (Note [Rank allocator]). The delay (ms) is one
#: that no step outlasts.
MIMALLOC_ENV = {"MIMALLOC_PURGE_DELAY": str(24 * 3600 * 1000)}


def rank_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The allocator variable the launcher gives every rank (Note [Rank allocator]): the launcher's own
    ``ZERORUN_ALLOCATOR`` (``environ``, default ``os.environ``) if set, else ``auto``; the job's environment files
    and ``launch.env`` override it, and each node's watcher turns it into that node's variables with
    :func:`allocator_env`.

    Raises:
        ZerorunError: the launcher's ``ZERORUN_ALLOCATOR`` is not one of ``ALLOCATORS``.
    """
    value = (os.environ if environ is None else environ).get(ALLOCATOR_VAR) or "auto"
    if allocator_problem(value):
        from zerorun.errors import ZerorunError  # not at the top: a rank imports this module before it allocates

        raise ZerorunError(f"environment: {allocator_problem(value)}")
    return {ALLOCATOR_VAR: value}


def find_tcmalloc() -> str | None:
    """The soname of a tcmalloc this machine's dynamic loader finds (its ``ldconfig`` cache), or None."""
    import ctypes.util

    for soname in TCMALLOC_SONAMES:
        name = soname[3:].split(".so")[0]
        if ctypes.util.find_library(name) == soname:
            return soname
    return None


def allocator_env(env: dict[str, str], tcmalloc: str | None, mimalloc: str | None = None) -> dict[str, str]:
    """The variables that carry out Note [Rank allocator] for ranks whose environment is ``env`` (this node's
    variables with the job's on top), on a node where ``tcmalloc`` (a soname) and ``mimalloc`` (a path: the
    pip wheel's library, :func:`find_mimalloc`) are found (None: not there).

    ``auto`` preloads tcmalloc, else mimalloc (``LD_PRELOAD``), unless the job (or the node) preloads a library
    itself (which may be an allocator: ``ZERORUN_ALLOCATOR=preload``) or sets ``MALLOC_MMAP_THRESHOLD_``;
    ``tcmalloc`` and ``mimalloc`` preload that one unless the job preloads its own; mimalloc gets
    :data:`MIMALLOC_ENV` where the job does not set those variables. Otherwise, and for
    ``glibc``, glibc's tuning (:data:`GLIBC_ENV`) where the job does not set those variables. The result also
    names the choice made (``ZERORUN_ALLOCATOR=tcmalloc``, ``mimalloc``, ``preload`` or ``glibc``) and always
    has :data:`TCMALLOC_QUIET`, which only a tcmalloc reads; the rank reports what it really runs under
    (:func:`name`).

    Raises:
        ValueError: ``ZERORUN_ALLOCATOR`` is not one of ``ALLOCATORS`` (a recipe's ``launch.env`` is checked
            before launch: :func:`zerorun.recipe.text.check_env`), or names an allocator this node lacks.
    """
    choice = env.get(ALLOCATOR_VAR, "auto")
    if choice not in ALLOCATORS:
        raise ValueError(f"{ALLOCATOR_VAR}={choice!r}: expected one of {', '.join(ALLOCATORS)}")
    found = {"tcmalloc": tcmalloc, "mimalloc": mimalloc}
    if choice in found and not found[choice]:
        how = INSTALL_HINT.split(", or ")[0 if choice == "mimalloc" else 1]
        raise ValueError(f"{ALLOCATOR_VAR}={choice}, but this node has no {choice} (install: {how})")
    quiet = {**TCMALLOC_QUIET, **{k: env[k] for k in TCMALLOC_QUIET if k in env}}
    if choice == "auto" and "MALLOC_MMAP_THRESHOLD_" not in env:  # the job tuning glibc asks for glibc
        choice = "tcmalloc" if tcmalloc else "mimalloc" if mimalloc else "glibc"
    if choice in found and not env.get("LD_PRELOAD"):
        mi = {**MIMALLOC_ENV, **{k: env[k] for k in MIMALLOC_ENV if k in env}} if choice == "mimalloc" else {}
        return {**quiet, **mi, "LD_PRELOAD": found[choice], ALLOCATOR_VAR: choice}
    label = "preload" if env.get("LD_PRELOAD") else "glibc"
    return {**GLIBC_ENV, **{k: env[k] for k in GLIBC_ENV if k in env}, **quiet, ALLOCATOR_VAR: label}


def fallback_note(env: dict[str, str], resolved: dict[str, str], host: str) -> str | None:
    """One line for a node whose ranks ``auto`` left under glibc tuned for want of tcmalloc and mimalloc
    (``env``: their environment before :func:`allocator_env`, ``resolved``: its result), else None."""
    if env.get(ALLOCATOR_VAR, "auto") != "auto" or resolved.get(ALLOCATOR_VAR) != "glibc":
        return None
    if "MALLOC_MMAP_THRESHOLD_" in env:  # the job tunes glibc itself: its choice
        return None
    return (f"zerorun: note: {host} has neither tcmalloc nor mimalloc: its ranks run under glibc tuned, the slow "
            f"fallback (install: {INSTALL_HINT})")
