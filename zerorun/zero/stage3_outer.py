"""Stage 3: the parts of the model outside the listed units, gathered on a schedule learned in the first step.

Note [Outer units]: the modules outside every listed unit (a GPT's embeddings, final norm and LM head; found
by ``units.outer_modules``) were the root unit's, gathered from the start of the forward to its end and
again through the whole backward: for a 55M GPT with a 16k vocabulary a third of the parameters, whole on
every rank at the peak (the start of backward), which is most of what stage 3 fell short of its promised
saving (ZeRO paper §5.3: only the parameters in use are whole). Each such module is now a unit of its own, an
outer unit. It cannot simply be gathered when it runs, as the listed units are: an outer module may run on
some ranks only (an expert on the root that no token reached on one rank), and an all-gather issued by some
ranks alone hangs. So the all-gathers of an outer unit are tied to points every rank reaches together, the
forward calls and backward entries of the listed units (every rank runs the same ones: Note [Same units on
every rank]):

- First step (learning): outer units are gathered with the root, as before. Each records the window in which
  it ran: ``first``/``last``, the number of listed-unit forward calls before its first call and at the end of
  its last one, and ``bfirst``, the number of listed-unit backward entries before the gradient of its output
  first arrived; a use of its parameters outside its own forward (a weight read by the root or by another
  unit, a backward hook) marks it ``used_outside``.
- The first step's norm all-reduce carries every rank's windows (``[x, x*x]`` per value, as the gather digest:
  equal on every rank exactly when ``N * sum(x*x) == sum(x)**2``). An outer unit whose windows are the same on
  every rank and that was not used outside is ``scheduled``; the others stay with the root for good.
- From then on a scheduled unit is all-gathered (asynchronously) when listed-unit call ``first`` begins (0:
  the root's forward), freed when call ``last + 1`` begins (or at the end of the forward), all-gathered again
  at backward entry ``bfirst`` (0: the start of backward; none when its output took no gradient) and freed
  as soon as its gradient buckets are complete, as a listed unit is. Whether it runs on a rank no longer
  matters: every rank gathers it at the same point.
- A scheduled unit that runs, or whose parameters are used, where the first step did not show it (its
  forward outside its window, its output's gradient arriving while it is free, its parameters read by other
  code) is an error on that rank, never a silent read of the freed placeholder; the message names the way out:
  ``zerorun.zero.register_external_parameter(model, param)`` keeps the module's unit with the root.

Evaluation (a forward with gradients off) gathers the scheduled units with the root, as before.
"""

from __future__ import annotations

import functools

import torch

from zerorun.zero.torch_internals import in_backward
from zerorun.zero.units import Unit, UnitState, tensors_in


class OuterUnits:
    """Note [Outer units]; mixed into :class:`~zerorun.zero.stage3.Stage3Engine`."""

    def _outer_setup(self) -> None:
        self._outers = [u for u in self.units if u.outer]
        self._learning = bool(self._outers)
        self._pass = False  # a forward of the root with gradients on is running
        self._calls = 0  # listed units' forward calls since the root's forward began
        self._bcalls = 0  # listed units' backward entries since backward began
        self._traced = {"forward": False, "backward": False}
        for unit in self._outers:  # gathered with the root until the first step agrees on a schedule
            if unit not in self._root.external:
                self._root.external.append(unit)
            self._handles.append(unit.module.register_forward_pre_hook(functools.partial(self._outer_pre_forward,
                                                                                         unit)))
            self._handles.append(unit.module.register_forward_hook(functools.partial(self._outer_post_forward, unit)))

    def _scheduled(self) -> list[Unit]:
        return [u for u in self._outers if u.scheduled]

    # ------------------------------------------------------------------------------------------- forward
    def _outer_pass_start(self) -> None:
        """The root's forward begins (not a recomputation); the root is gathered."""
        self._pass = torch.is_grad_enabled()
        self._calls = 0
        for unit in self._scheduled():
            if not self._pass or unit.first == 0:  # evaluation: with the root, as before
                self._gather(unit, wait=False)

    def _outer_pass_end(self) -> None:
        if self._pass and self._learning:
            self._traced["forward"] = True
        self._pass = False

    def _outer_listed_call(self) -> None:
        """A listed unit's forward call begins (before its all-gather is issued)."""
        if not self._pass:
            return
        self._calls += 1
        for unit in self._scheduled():
            if unit.last + 1 == self._calls and unit.active == 0:
                self._free(unit)
            if unit.first == self._calls:
                self._gather(unit, wait=False)

    def _outer_pre_forward(self, unit: Unit, module, args) -> None:
        if in_backward() or not self._pass:
            if self._learning and in_backward():
                unit.used_outside = True  # recomputed in backward: no window to learn
            return
        if self._learning:
            if not self._traced["forward"]:
                unit.first = self._calls if unit.first is None else unit.first
                unit.last = self._calls
        elif unit.scheduled:
            if unit.state is UnitState.FREE:
                raise self._outer_deviation(unit, f"ran after {self._calls} forward calls of the listed units")
            self._gather(unit)
        unit.active += 1
        self._active.append(unit)

    def _outer_post_forward(self, unit: Unit, module, args, output):
        if in_backward() or not self._pass:
            return output
        unit.active -= 1
        if self._active and self._active[-1] is unit:
            self._active.pop()
        if self._learning and not self._traced["forward"]:
            unit.last = self._calls  # a listed unit called from inside it widens its window
        if torch.is_grad_enabled():
            for t in tensors_in(output):
                if t.requires_grad:
                    t.register_hook(lambda grad, unit=unit: self._outer_pre_backward(unit))
        return output

    # ------------------------------------------------------------------------------------------ backward
    def _outer_backward_start(self) -> None:
        """Backward begins; the root is gathered."""
        self._bcalls = 0
        for unit in self._scheduled():
            if unit.bfirst == 0:
                self._gather(unit, wait=False)

    def _outer_listed_backward(self) -> None:
        """A listed unit's backward begins (a new entry in the backward order)."""
        self._bcalls += 1
        for unit in self._scheduled():
            if unit.bfirst == self._bcalls:
                self._gather(unit, wait=False)

    def _outer_pre_backward(self, unit: Unit) -> None:
        if self._learning:
            if not self._traced["backward"] and unit.bfirst is None:
                unit.bfirst = self._bcalls
            return
        if unit.scheduled:
            if unit.state is UnitState.FREE:
                raise self._outer_deviation(unit, f"took a gradient after {self._bcalls} backward entries of the "
                                                  "listed units")
            self._gather(unit)

    def _outer_backward_end(self) -> None:
        if self._learning:
            self._traced["backward"] = True

    # ------------------------------------------------------------------------------------- parameter use
    def _outer_use(self, unit: Unit, func) -> bool:
        """A parameter of the outer unit ``unit`` is about to be read by ``func`` (Note [Parameters at rest]):
        ``True`` when it may be, ``False`` to go on as for any unit."""
        holder = self._active[-1] if self._active else None
        if holder is not unit and (self._pass or in_backward()):  # an evaluation's forward decides nothing
            if self._learning:
                unit.used_outside = True
            elif unit.scheduled:
                raise self._outer_deviation(unit, f"had a parameter read outside its own forward (by "
                                                  f"{getattr(func, '__name__', func)})")
        if unit.state is UnitState.GATHERING:
            self._gather(unit)
        return unit.state is UnitState.GATHERED

    def _outer_codes(self) -> list[float]:
        """This rank's windows, three values per outer unit (0: not schedulable), for the first step's
        all-reduce."""
        out: list[float] = []
        for u in self._outers:
            ok = u.first is not None and not u.used_outside and not u.declared
            out += [u.first + 1 if ok else 0, u.last + 1 if ok else 0,
                    u.bfirst + 1 if ok and u.bfirst is not None else 0]
        return out

    def _outer_agree(self, sums: list[float], squares: list[float]) -> None:
        """After the first step's all-reduce: schedule the outer units whose windows every rank shares."""
        n = self.world_size
        for i, unit in enumerate(self._outers):
            same = all(n * squares[3 * i + j] == sums[3 * i + j] ** 2 for j in range(3))
            if same and sums[3 * i] > 0:
                unit.scheduled = True
                unit.bfirst = None if sums[3 * i + 2] == 0 else unit.bfirst
                if unit in self._root.external:
                    self._root.external.remove(unit)
                unit.pinned_by.discard(self._root)
            else:  # stays with the root: its windows were this rank's alone
                unit.first = unit.last = unit.bfirst = None
        self._learning = False

    def _outer_deviation(self, unit: Unit, what: str) -> RuntimeError:
        return RuntimeError(
            f"stage 3: module {unit.name!r} (outside the units of zero.units) {what}, where the first step did "
            f"not (forward calls {unit.first}-{unit.last}, backward entry {unit.bfirst}); its all-gathers are "
            "scheduled from the first step on every rank (Note [Outer units]), so it cannot be gathered here on "
            "this rank alone. Keep its parameters with the root unit: "
            "zerorun.zero.register_external_parameter(model, param) for each, before the first step")
