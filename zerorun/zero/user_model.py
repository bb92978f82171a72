"""What keeps the user's model the user's at every stage: its parameter objects and their trainability are
checked before every forward and backward, and parameters can be read and written whole in a block.

Note [The user's model stays the user's]: the engine lays out, reduces and updates the ``nn.Parameter``
objects trainable when it was built. A parameter unfrozen later would never be trained, one frozen later
would still be updated (zero gradients, weight decay, momentum), and a Parameter object put in the place of
another would never be trained: all silently. Each is a clear error instead, naming the parameter.

Note [One backward per micro-step]: the engine reduces the gradients that ``engine.backward`` accumulates. A
backward the user runs around it on the same parameters (``aux.backward(retain_graph=True)`` on an output, then
``engine.backward(loss)``) accumulated into the gradient buffers unreduced at stages 0-1 (the step silently
trained on this rank's share of it) and failed inside the reducer at stages 2-3 (a ``KeyError``). So a
parameter's gradient accumulated outside ``engine.backward`` raises, in the gradient hook, on every rank that runs
that backward, naming the parameter: as DDP refuses a second backward of one iteration. Gradients of other
tensors (``torch.autograd.grad(loss, inputs)``: adversarial examples, input-gradient penalties) accumulate into
no parameter and pass. The step's gradients are then partial: Note [A backward that raised].

Note [User gradient hooks run first]: the reducer takes each parameter's gradient in a post-accumulate-grad hook
and, at stages 2-3, moves it into a bucket and sets ``p.grad`` to None. torch runs a parameter's post-accumulate
hooks in the order they were registered, so a user's hook registered after ``initialize`` (a gradient scaled or
logged per parameter) ran after the reducer's: it found ``p.grad`` None (an ``AttributeError`` in the user's
code), and a scaling would have been lost. Under DDP a user's hook runs before the gradient is reduced, whenever
it was registered. So each ``engine.backward`` first moves the reducer's hook behind the others on every
parameter (``torch_internals.run_last``): a user's hook sees and may change this rank's gradient, before its
reduction, as under DDP. A user's hook that returns a value (``lambda p: p.grad.mul_(0.5)`` returns the
gradient) has torch pass that value to the next hook and then raise "Tensor post accumulate grad hooks should
return None": the reducer's hook lets such a value through, so torch's message is the one raised (before: a
``KeyError`` printing the gradient).

Note [Sparse gradients]: a parameter whose gradient is sparse (``nn.Embedding(sparse=True)``) gets it densified
in the reducer's hook: the bucket is dense, and at stages 2-3 copying a sparse tensor into it raised torch's
"copy_() between dense and sparse Tensors is not implemented". The reduced gradient, and ``p.grad`` at stages
0-1, are dense: the same values as DDP's sparse all-reduce, in the memory of ``sparse=False``.

Note [A backward that raised]: a backward that raises midway (a custom autograd function's check, a user's
gradient hook, an out-of-memory error; at stages 0-2 one outside ``engine.backward`` too, Note [One backward per
micro-step], which stage 3 refuses before any gradient accumulates: nothing to drop there) leaves some of the
step's gradients accumulated and others not, at stages 2-3 a bucket half filled. The next backward added to them:
stages 0-1 trained silently on that partial gradient summed with the next micro-step's, stages 2-3 failed inside
the reducer (a ``KeyError``). Plain PyTorch leaves the choice to the user:
``optimizer.zero_grad()`` and the next batch. So after it, ``engine.backward`` and ``engine.step`` raise one line
naming the error, before any collective, until ``engine.zero_grad()`` (DeepSpeed's name): it waits for the
reductions in flight, drops every gradient since the last step (every micro-step of it, as
``optimizer.zero_grad()``), frees stage 3's units and begins the step again; training goes on as plain PyTorch
that skipped the batch. A forward (evaluation) is not refused. The reductions in flight pair up only where every
rank raised at the same point (an error every rank meets alike); an error on one rank alone leaves the others
waiting in a collective until the collective timeout, as under DDP. A drop on some ranks only would train on
gradients that differ by rank (a step skipped where one rank saw a NaN loss). At stages 0-1, which reduce at the
last micro-step only, whether this step's gradients were dropped rides the step's agreement (``agreements.py``),
and where the ranks differ every rank raises at the end of its last backward; at stages 2-3 the micro-step run
again reduce-scatters on that rank alone, so the ranks' collectives differ before any agreement: a wait until
the collective timeout, as any step skipped on one rank under DDP (a check before that would be a collective
per micro-step). A call with nothing to drop (no backward since the step, none raised) does
nothing, so a loop may call it at the start of every step, as with torch's optimizers.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Iterable

import torch
import torch.nn as nn

if TYPE_CHECKING:
    from zerorun.zero.flat import FlatBuffer
    from zerorun.zero.param_writes import ParamWrites


def backward_outside_engine(name: str) -> RuntimeError:
    """The error of Note [One backward per micro-step], for the parameter ``name``."""
    return RuntimeError(
        f"parameter {name!r} got a gradient from a backward outside engine.backward (tensor.backward() or "
        "torch.autograd.backward over the model): the engine reduces only what engine.backward accumulates, so it "
        "would train on this rank's gradient alone. Add the losses and call engine.backward(total) once per "
        "micro-step; for gradients of inputs only, use torch.autograd.grad(loss, inputs)")


def spoiled_by(error: BaseException) -> str:
    """``error`` in one line, for the refusal of Note [A backward that raised]."""
    return f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}"


def zero_grad_on_some_ranks() -> RuntimeError:
    """The error of Note [A backward that raised] where ``engine.zero_grad`` dropped gradients on some ranks."""
    return RuntimeError("engine.zero_grad() dropped this step's gradients on some ranks only, so the ranks' gradients "
                        "differ and this step is refused on every rank: call engine.zero_grad() on every rank alike "
                        "(after a backward that raised on every rank), then begin the step again")


def parameter_slots(model: nn.Module, pointers: bool) -> list[tuple]:
    """Note [The user's model stays the user's]: each parameter's ``(module, key, name, object, requires_grad,
    dtype, data pointer)``, as :meth:`UserModel.check_parameters` holds them from ``initialize`` on (the pointer,
    with ``pointers``: a trainable parameter's, a view of its flat buffer at stages 0-2; else None)."""
    return [(mod, key, f"{mname}.{key}" if mname else key, p, p.requires_grad, p.dtype,
             p.data_ptr() if pointers and p.requires_grad else None)
            for mname, mod in model.named_modules() for key, p in mod._parameters.items() if p is not None]


class UserModel:
    """Mixed into :class:`~zerorun.zero.engine.ZeroEngine` (which provides ``_param_slots``, ``buffers``,
    ``comm``, ``masters`` and the slice accessors)."""

    #: set by ``close()``: forward, backward and step are refused from then on
    closed = False
    #: stages 0-2: the parameters' version counters when the engine last wrote them (Note [Writes between steps])
    writes: ParamWrites | None = None

    def check_open(self) -> None:
        """Raises RuntimeError once ``close()`` released the engine's swap files and reader thread (before: a
        forward and a backward ran on, and a step failed inside a thread pool)."""
        if self.closed:
            raise RuntimeError("this engine was closed (engine.close()): it trains no more; build a new one with "
                               "zerorun.zero.initialize (and load a checkpoint to go on)")

    def check_grads(self) -> None:
        """Note [A backward that raised]: raises RuntimeError, before any collective, after a backward that raised,
        until :meth:`zero_grad`."""
        if self.reducer.spoiled is not None:
            raise RuntimeError(f"a backward raised ({self.reducer.spoiled}) and left this step's gradients partial: "
                               "backward and step are refused until engine.zero_grad() on every rank drops them "
                               "(every micro-step since the last engine.step()); then begin the step again, with "
                               "this batch or the next")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop every gradient accumulated since the last :meth:`step` (all its micro-steps) and begin the step
        again, after a backward that raised (Note [A backward that raised]). Every rank must call it; it issues no
        collective (it waits for the reductions in flight). Nothing to drop: a no-op. ``set_to_none`` is taken as
        torch's optimizers take it and changes nothing: the gradients live in the engine's buffers, zeroed either
        way.

        Raises:
            RuntimeError: the engine was closed.
        """
        self.check_open()
        if self._micro_step or self.reducer.spoiled is not None:
            self._zero_grads(discard=True)

    def check_parameters(self) -> None:
        """Note [The user's model stays the user's]: the engine partitions, reduces and updates the
        ``nn.Parameter`` objects that were trainable when it was built. Called before every forward and
        backward; O(number of parameters), no collective.

        Raises:
            RuntimeError: a parameter was replaced by another object, its ``requires_grad`` or its dtype changed,
                or at stages 0-2 its memory (no longer a view of its flat buffer), after :func:`initialize` (each
                would otherwise be silently ignored); the message names it; the engine was closed.
        """
        self.check_open()
        with torch._C.DisableTorchFunctionSubclass():  # stage 3's guard is not asked (Note [Parameters at rest])
            changed = [(name, q, p, trainable, dtype) for mod, key, name, p, trainable, dtype, ptr in self._param_slots
                       if (q := mod._parameters.get(key)) is not p or q.requires_grad != trainable or q.dtype != dtype
                       or ptr not in (None, q.data_ptr())]
        for name, q, p, trainable, dtype in changed[:1]:
            if q is not p:
                raise RuntimeError(
                    f"parameter {name!r} was replaced by another object after zerorun.initialize: the engine "
                    "trains the Parameter objects it was given, so the new one would never be trained. Write the "
                    "new values into the existing parameter in place instead (with torch.no_grad(): "
                    "p.copy_(values); at stage 3 inside engine.gathered_parameters([p], modifier_rank=0))")
            if q.dtype != dtype or q.requires_grad == trainable:  # a review: stage 2 trained nothing, exit 0
                what = f"was cast to {q.dtype}" if q.dtype != dtype else "holds other memory than the engine's"
                raise RuntimeError(
                    f"parameter {name!r} {what} after zerorun.initialize (a model.half(), .to(), an RNN's "
                    "flatten_parameters() or p.data = ... in the model): the engine keeps it as "
                    f"{dtype} in its flat buffers, so the step's updates would "
                    "not reach it, or be undone. Choose the parameters' dtype with precision (bf16, fp16), cast "
                    "inputs or activations in forward instead, and write values in place (with torch.no_grad(): "
                    "p.copy_(values))")
            if q.requires_grad != trainable:
                raise RuntimeError(
                    f"parameter {name!r} was {'unfrozen' if q.requires_grad else 'frozen'} "
                    f"(requires_grad={q.requires_grad}) after zerorun.initialize: the engine partitions the "
                    "parameters trainable when it was built, so the change would be silently ignored. Set "
                    "requires_grad before initialize (a parameter to train later can stay trainable in a param "
                    "group of its own whose lr is 0 until then), or build a new engine")

    @contextlib.contextmanager
    def gathered_parameters(self, params: Iterable[nn.Parameter], modifier_rank: int | None = None):
        """Context manager: ``params`` whole inside the block (they always are at stages 0-2; stage 3 gathers
        them, :meth:`Stage3Engine.gathered_parameters`). Every rank must enter it. With ``modifier_rank`` (a
        rank of the engine's group), the values that rank holds on exit are broadcast to every rank and kept,
        master slices included: in-place writes made there take effect everywhere, also when the block raises (on
        every rank: before, the ranks went on with different values, silently)."""
        params = list(params)
        self.take_writes()  # before ``before``: a write made before the block is the user's (found by review)
        bufs = [b for b in self.buffers if any(p in b.slots for p in params)]
        before = {b: self._param_slice(b).clone() for b in bufs} if modifier_rank is not None else {}
        try:
            yield
        finally:
            if modifier_rank is not None:
                tensors = [b.data for b in bufs] + [p.data for p in params if not p.requires_grad]
                self.comm.wait([self.comm.broadcast(t, modifier_rank) for t in tensors])
                self._masters_take(bufs, before)

    def _masters_take(self, bufs: list[FlatBuffer], before: dict | None = None) -> None:
        """The master slices of ``bufs`` take the elements of their parameter slices that differ from
        ``before[buf]`` (their values before a user's write; ``None``: the masters cast to the parameters' dtype,
        Note [Writes between steps] in param_writes.py); nothing to do where masters are the slices. The
        comparison runs on the masters' device (host memory with optimizer offload)."""
        if not bufs:
            return
        index = {b: i for i, b in enumerate(self.buffers)}
        masters = self.masters.master_slices()
        changed = {}
        for buf in bufs:
            i = index.get(buf)
            now = self._param_slice(buf)
            if i is None or masters[i].data_ptr() == now.data_ptr():
                continue
            now = now.to(masters[i].device)
            was = masters[i].to(now.dtype) if before is None else before[buf].to(now.device)
            moved = now != was
            if bool(moved.any()):
                changed[i] = masters[i].clone()
                changed[i][moved] = now[moved].to(changed[i].dtype)
        if changed:  # the optimizer state stays as it is
            self.masters.set_values([changed.get(i, m) for i, m in enumerate(masters)])
        if self.writes is not None:
            self.writes.mark(bufs)

    def take_writes(self) -> None:
        """Note [Writes between steps] in param_writes.py: the masters take the parameters written in place since
        the engine last wrote them (stages 0-2; host reads of version counters, a comparison where written). Done
        by the step, a checkpoint's save and ``gathered_parameters``; local, no collective."""
        if self.writes is not None:
            self._masters_take(self.writes.written())
