"""The rank allocator (Note [Rank allocator]): which malloc each rank runs under, torch-free, so that the
launcher (the launch plan, each node's watcher, ``zerorun env``) and the rank (its start event) share it
without the launcher importing zero/. What only a rank does to glibc's malloc from inside (``mallopt``,
``malloc_trim``: Note [Returning freed memory]) is zero/allocator.py's. Imports nothing of zerorun at its top: a
rank imports it (through zero/allocator.py) before it allocates anything.

Note [Rank allocator]: zerorun's ranks run under gperftools' tcmalloc where their node has it (Debian/Ubuntu
package ``libtcmalloc-minimal4``; ``.ci/run`` installs it), else under Microsoft's mimalloc, whose shared library
comes with zerorun from pip (the ``cmeel-mimalloc`` wheel, a dependency: :func:`find_mimalloc`; issue 35: a fresh
install, where nobody ran apt-get, gets a fast allocator too), either preloaded by each node's watcher
(:func:`allocator_env`; ``ZERORUN_ALLOCATOR`` in the recipe's ``launch.env`` or the launcher's environment may
name ``tcmalloc``, ``mimalloc`` or ``glibc``), and under glibc with the tuning of Note [Returning freed memory]
(zero/allocator.py) where a node has neither (its watcher prints one line saying what to install:
:func:`fallback_note`). mimalloc is the fallback's replacement, not tcmalloc's: in one
run on a loaded machine (issue 35; 55M GPT, 2 gloo ranks, micro-batch 8; docs/benchmarks.md, "What a fresh
install runs"), CPU seconds per step and rank against DDP as torchrun runs it were stage 1 1.08x, stage 2 1.11x,
stage 3 1.22x under
mimalloc, 0.93x, 0.92x, 0.84x under tcmalloc and 1.15x, 1.17x, 1.22x under glibc tuned, with realized savings of
0.99, 0.98, 0.83 (tcmalloc 1.00, 1.00, 0.89; glibc tuned 1.00, 1.00, 0.99): mimalloc faults in a sixth of glibc
tuned's pages but still pays 0.9-1.4 kernel seconds a step, because it returns freed memory to the kernel after a
delay (``MIMALLOC_PURGE_DELAY``, 1 s) shorter than a step and faults it in again. So the watcher gives mimalloc
``MIMALLOC_PURGE_DELAY=-1`` (:data:`MIMALLOC_KEEP`; the job's own value wins): it then keeps
and reuses what it frees, as tcmalloc does, and in a second run stage 2 took 1.00x tcmalloc's CPU time (4.45
against 4.47 s a step; 0.84x DDP's step time under torchrun), but held 1618 MiB at its peak against tcmalloc's
1443 (stage 0: 2022 against 1772, so the realized saving reads 1.29); in a third, stage 1 1.03x and stage 3
0.94x tcmalloc's CPU time, but stage 3 held 1708 MiB against tcmalloc's 1382 (0.75 of its saving): the price of
keeping, where a job that needs the memory sets ``MIMALLOC_PURGE_DELAY`` itself or asks for glibc.
torch's own CPU launcher offers the same preload (``torch.backends.xeon.run_cpu --enable-tcmalloc``). Why: the
fixed mmap threshold keeps what ZeRO frees off the peak but makes every rank fault in each large block anew on
every use, and a step of stage 3, which gathers and frees every unit twice, the most; tcmalloc keeps freed
blocks in its page heap and reuses them, so nothing is faulted in after the first step, and it does not let the
heap grow with holes the way glibc's raised threshold does. Measured side by side, 2 interleaved rounds on an
idle machine (55M GPT, 2 gloo ranks, micro-batch 4; ``benchmarks/zero_stages.py --envs default,alloc,tcmalloc``;
docs/benchmarks.md, "The allocator"): step time glibc tuned -> tcmalloc, stage 1 1.56 -> 1.28 s, stage 2 1.57 ->
1.27 s,
stage 3 1.95 -> 1.45 s, DDP 1.68 -> 1.43 s (DDP under glibc's defaults, as torchrun runs it: 1.53 s); peak RSS
per rank stage 1 1248 -> 1284 MiB, stage 2 1143 -> 1254, stage 3 1094 -> 1154 (glibc defaults: 1417, 1367,
1241). Stages 2 and 3 keep less of their saving under tcmalloc (realized 0.75 and 0.80, against 1.00 and 0.87
tuned; tcmalloc's peak also moves between runs: the bytes in use are the same, but its heap grows by a 32 MiB
block, or not, at a step chosen by chance, when no free span is whole enough for it; neither gperftools'
aggressive decommit, which faults everything in again, nor its faster release rate, nor releasing free spans
between phases of the step helped: docs/benchmarks.md, "The allocator"): ``ZERORUN_ALLOCATOR: glibc`` trades that
speed
for memory. Those figures are from before stage 3's tails and the adopted gradients (Notes [Outer units],
[Adopted gradient]); after them, in one run of every mode (benchmarks/results/history.md, "Issue 21: stage 3's
peak"), tcmalloc keeps 1.02 and 0.92 of stages 2 and 3's saving (1176 and 1108 MiB, glibc tuned 1144 and 1044) at
1.358 and 1.510 s,
0.84x and 0.94x DDP as torchrun runs it; at micro-batch 8 stage 3 under tcmalloc keeps 0.90 or 0.75 by run
(each stage's peak lands on one of two values 62 MiB apart: benchmarks/results/history.md, "Issue 21: stage 3's
peak").
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
#: mimalloc keeps what a rank frees instead of returning it to the kernel after 1 s (its default, shorter than a
#: step: every step faulted its memory in again) and reusing it, as tcmalloc does (Note [Rank allocator]).
MIMALLOC_KEEP = {"MIMALLOC_PURGE_DELAY": "-1"}


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
    :data:`MIMALLOC_KEEP` unless the job sets it. Otherwise, and for
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
        raise ValueError(f"{ALLOCATOR_VAR}={choice}, but this node has no {choice} (install: {INSTALL_HINT})")
    quiet = {**TCMALLOC_QUIET, **{k: env[k] for k in TCMALLOC_QUIET if k in env}}
    if choice == "auto" and "MALLOC_MMAP_THRESHOLD_" not in env:  # the job tuning glibc asks for glibc
        choice = "tcmalloc" if tcmalloc else "mimalloc" if mimalloc else "glibc"
    if choice in found and not env.get("LD_PRELOAD"):
        keep = {**MIMALLOC_KEEP, **{k: env[k] for k in MIMALLOC_KEEP if k in env}} if choice == "mimalloc" else {}
        return {**quiet, **keep, "LD_PRELOAD": found[choice], ALLOCATOR_VAR: choice}
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
