"""What a layer's forward must start from when the eager export's checkpoint re-runs it in backward: the
states of Python's and NumPy's global generators, and the Python numbers the layer's modules hold.

Why: checkpoint restores torch's generators for the recompute (`preserve_rng_state`) and nothing else,
and a recompute must compute what the forward computed. A layer whose forward draws from `random` or
`numpy.random` (`slackswap.runtime.host_draws`) draws other numbers in the recompute, and a layer whose
forward changes a number of its own modules that it reads (`self.calls += 1; h * (1 + 0.1 * self.calls)`:
an annealing step or a call count kept in forward) reads the changed number and changes it a second time.
Measured before this: full_recompute and torch_sac through the eager export gave a wrong gradient on every
step for both, and the counter stood at 6 after 3 steps.

How: in an audited step each layer's forward is read before and after it runs: the generators' states
(`host_draws.draw_states`: the global ones and those its modules hold) and the numbers its modules and
the plain objects they hold carry (the dict-held slots of `runtime.module_numbers`, a few us a
layer). A layer whose forward moved either records them before its forward at every step from then on,
and its recompute runs from them and puts back what it found after (as checkpoint does for torch's RNG).
Layers that moved neither pay nothing in the steady steps. Compiled, the recompute is torch's: a layer
whose first call after installation drew is refused before backward (`refused_when_drawing`; measured,
full_recompute compiled read gradients 1.8e-4 to 5.2e-4 off eager where the same step without draws is
5.6e-9 off).

Not seen: a module global or closure value a layer's forward changes (`COUNT[0] += 1`), a class attribute
it changes, a generator object held outside its modules, a layer that starts moving either in a step that
is not audited; docs/runtime.md, "Numbers drawn in forward".
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from slackswap.runtime.errors import RuntimeUsageError
from slackswap.runtime.host_draws import draw_states, drawn_from, own_generators, set_draw_states
from slackswap.runtime.module_numbers import number_slots


class ReplayedState:
    """Per layer of an installation of the eager export: whether its forward draws (`drawing`) or changes its
    modules' numbers (`changing`), seen in an audited step, and the function checkpoint runs for a call."""

    def __init__(self, layers: list[torch.nn.Module]) -> None:
        self._slots = [tuple((table, key) for table, key in number_slots(list(layer.modules())) if type(table) is dict)
                       for layer in layers]
        self._layers = layers
        #: Layers (regions) whose forward drew from a global generator in an audited step.
        self.drawing: set[int] = set()
        #: Layers whose forward changed a number of their modules in an audited step.
        self.changing: set[int] = set()

    def _numbers(self, region: int) -> tuple:
        return tuple([table.get(key) for table, key in self._slots[region]])

    def _put(self, region: int, numbers: tuple) -> None:
        for (table, key), value in zip(self._slots[region], numbers, strict=True):
            table[key] = value

    def function(self, region: int, forward: Callable, auditing: bool) -> Callable:
        """What `checkpoint` runs for one call of layer `region`: `forward` itself where the layer moves
        nothing; else a function whose first call (the forward) records what it starts from, and whose later
        calls (the recompute) start from that and put back what they found."""
        if not auditing and region not in self.drawing and region not in self.changing:
            return forward
        start: tuple | None = None
        own = own_generators(self._layers[region])  # the generator objects the layer holds at this call

        def run(*args: object, **kwargs: object) -> object:
            nonlocal start
            if start is None:
                start = (draw_states(own), self._numbers(region))
                out = forward(*args, **kwargs)
                if auditing:
                    if drawn_from(start[0], draw_states(own), own) is not None:
                        self.drawing.add(region)
                    if self._numbers(region) != start[1]:
                        self.changing.add(region)
                return out
            if region not in self.drawing and region not in self.changing:
                return forward(*args, **kwargs)
            found = (draw_states(own), self._numbers(region))
            set_draw_states(start[0], own)
            self._put(region, start[1])
            try:
                return forward(*args, **kwargs)
            finally:
                set_draw_states(found[0], own)
                self._put(region, found[1])

        return run

    @staticmethod
    def refused_when_drawing(path: str, layer: torch.nn.Module, call: Callable) -> Callable:
        """The compiled export's call of `layer` (at `path`): its first call after installation is read for
        draws (the global generators and those the layer holds), and a forward that drew is refused before
        its backward runs."""
        checked = False

        def run(*args: object, **kwargs: object) -> object:
            nonlocal checked
            if checked:
                return call(*args, **kwargs)
            own = own_generators(layer)
            before = draw_states(own)
            out = call(*args, **kwargs)
            checked = True
            drawn = drawn_from(before, draw_states(own), own)
            if drawn is not None:
                raise RuntimeUsageError(
                    f"layer {path!r} draws from {drawn} in its forward, and the compiled export's recompute "
                    "would draw other numbers: install the export eager (installed(model)), which replays them")
            return out

        return run


__all__ = ["ReplayedState"]
