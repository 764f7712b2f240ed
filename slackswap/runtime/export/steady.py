"""The eager export's steps after the audited one: run from the audited step's `CallTable`s.

Why: naming each ATen call (module path, packet, count), asking the plan's policy, and recording what
it decided cost, per call, about twice what PyTorch's own selective checkpointing costs with a
hand-written policy making the same decisions. The decisions depend only on the calls a layer makes,
so they are taken once, in an audited step, and a step with the same key (`_step_key`: input shapes,
dtypes, devices, train / grad / autocast modes) replays them by position (`_TableSaveMode`), naming
nothing. What guards the replayed decisions:
- a step whose key differs from the audited one's is audited again (a changed shape is never run on
  tables made for another);
- in a step run from the tables, every governed call is checked against the audited call at its
  position; where a layer's calls differ (a data-dependent path: a mixture of experts routing to other
  experts), the layer's forward is run again audited, from the same RNG state, so the step stays exact
  (its dropout masks are the ones a plain step draws), and that layer is audited at every step until
  the next whole audited step. A layer whose audited forward wrote into a tensor it did not make
  (module state such as BatchNorm's statistics, or an input) cannot be run twice: there the step is
  refused (`CallsDiffer`) and the next one audited.
`PlanExport.record` and `step_differences()` describe the last whole audited step, which the steps
after it execute."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import get_device_states, set_device_states

from slackswap.runtime.export.modes import CallsDiffer, CallTable
from slackswap.runtime.export.policy import StepRecord


class TableSteps:
    """`PlanExport`'s steady-state half (a mixin): when a step is audited, the tables it leaves, and the
    layer calls run from them."""

    def _init_steps(self) -> None:
        #: (region, its call number in the step) -> the audited forward's `CallTable`.
        self._tables: dict[tuple[int, int], CallTable] = {}
        #: The key (`_step_key`) of the step the tables come from; None before any audited step.
        self._audited_key: tuple | None = None
        self._audit_next, self._audit_all, self._auditing = False, 0, True
        self._pending_key: tuple | None = None
        self._region_calls: dict[int, int] = {}
        #: Layers whose calls differed from their table since the last audited step: audited each step.
        self._data_dependent: set[int] = set()
        #: (call number, audited) of the layer call now starting (read by `context_fn`); None outside.
        self._current: tuple[int, bool] | None = None
        self._layers: list[torch.nn.Module] = []

    def audit_next_step(self) -> None:
        """The next eager step runs audited (every call named, the policy asked, `record` rewritten), as
        the first step after installation and every step whose key differs from the audited one's do."""
        self._audit_next = True

    def call_table(self, region: int, call: int = 0) -> CallTable:
        """The audited eager forward's decisions for call `call` of region `region` in a step, per ATen
        call (`CallTable.policies()`: as a selective-checkpoint policy would make them); the steps after
        it execute exactly these. Raises KeyError before any audited step."""
        return self._tables[(region, call)]

    def _step_key(self, model: torch.nn.Module, args: tuple, kwargs: dict) -> tuple:
        """What the layers' ATen calls depend on besides the code and the data: the inputs' shapes,
        dtypes and devices (plain values as they are, other objects by identity), train or eval, grad and
        autocast modes."""
        leaves = tuple((tuple(x.shape), x.dtype, x.device) if isinstance(x, torch.Tensor)
                       else x if isinstance(x, (int, float, bool, str, type(None))) else (type(x), id(x))
                       for x in tree_leaves((args, kwargs)))
        return (leaves, model.training, tuple(m.training for m in self._layers), torch.is_grad_enabled(),
                torch.is_autocast_enabled("cpu"), torch.is_autocast_enabled("cuda"))

    def _begin_step(self, model: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        """At the model's forward: audit this step (reset the record, name calls by module) or run it
        from the tables."""
        self._region_calls.clear()
        key = self._step_key(model, args, kwargs)
        self._auditing = self._audit_next or self._audit_all > 0 or key != self._audited_key
        self._pending_key = key
        if self._auditing:
            self._reset()
            self._tables.clear()
            self._data_dependent.clear()
            self._audited_key = None
            self.modules.__enter__()

    def _end_step(self, *_: object) -> None:
        """After the model's forward (also when it raised): module naming off again."""
        if self._auditing:
            self.modules.__exit__(None, None, None)

    def _commit_step(self, *_: object) -> None:
        """After a forward that returned: an audited step's tables serve the steps with its key."""
        if self._auditing:
            self._audited_key, self._audit_next = self._pending_key, False

    def _run_layer(self, region: int, forward: Callable, args: tuple, kwargs: dict) -> object:
        """One layer call under checkpoint (`forward(*args, **kwargs)` runs it): audited in an audited
        step, else from its table, else (no table, or calls that differed) audited alone."""
        call = self._region_calls.get(region, 0)
        self._region_calls[region] = call + 1
        if self._auditing:
            out = self._under(forward, args, kwargs, (call, True))
            self._note_outputs(out)
            return out
        table = self._tables.get((region, call))
        if table is None or region in self._data_dependent:
            return self._audited_alone(region, call, forward, args, kwargs)
        rng = torch.get_rng_state(), get_device_states(*args, *kwargs.values())
        try:
            return self._under(forward, args, kwargs, (call, False))
        except CallsDiffer:
            if table.writes_outside:
                self._audit_next = True
                raise
        torch.set_rng_state(rng[0])
        if rng[1][0]:
            set_device_states(*rng[1], device_type=next(
                x.device.type for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor) and x.is_cuda))
        self._data_dependent.add(region)
        return self._audited_alone(region, call, forward, args, kwargs)

    def _under(self, forward: Callable, args: tuple, kwargs: dict, current: tuple[int, bool]) -> object:
        self._current = current
        try:
            return forward(*args, **kwargs)
        finally:
            self._current = None

    def _audited_alone(self, region: int, call: int, forward: Callable, args: tuple, kwargs: dict) -> object:
        """One layer call audited inside a step run from the tables: named as in an audited step (the
        module stack seeded with the layer), recorded apart (`record` stays the audited step's)."""
        with self._layer_audit(region, call):
            return self._under(forward, args, kwargs, (call, True))

    @contextmanager
    def _layer_audit(self, region: int, call: int) -> Iterator[None]:
        record, last = self.record, self._last_names
        self.record, self._last_names = StepRecord(), {}
        path = self.regions[region]
        self.modules._calls.clear()
        self.modules._calls[path] = call + 1
        self.modules.stack[:] = [path if call == 0 else f"{path}@{call}"]
        self.modules.__enter__()
        try:
            yield
        finally:
            self.modules.__exit__(None, None, None)
            self.modules.stack.clear()
            self.record, self._last_names = record, last
