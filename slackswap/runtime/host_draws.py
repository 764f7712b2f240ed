"""Draws from Python's and NumPy's global random generators inside the model's forward: numbers that are
other numbers every step, and at every re-run of the forward.

Why: the runtime's recompute on hooks alone replays the verified step's recorded ATen calls with their
Python values, and the export's checkpoint re-runs a layer's Python forward in backward, which draws
again; torch's generators are restored for both (`torch.random.fork_rng`, checkpoint's
`preserve_rng_state`), these two are not. Such draws are common: Hugging Face's LayerDrop in MusicGen and
VITS (`random.uniform(0, 1)`, `np.random.uniform(0, 1)`), UDOP's `relative_position *=
random.uniform(...)`, wav2vec 2.0's SpecAugment masks (`np.random`). Measured before these checks:
`h * random.choice([0.5, 1.0, 2.0, 3.0])`, `h * float(np.random.rand())` and a `mul` skipped on
`random.random() < 0.5` before a recomputed softmax gave a wrong gradient on every hook-only step, and
full_recompute and torch_sac through the eager export on every step.

How:
- The runtime (`eager.run`): a recomputing plan's verified step reads both generators' states where the
  model's forward starts and where it returns (`draw_states`, `drawn_from`: 68 us for both reads and
  the comparison on this machine's CPU); a forward that moved either refuses the hook-only steps, so
  every step runs verified and exact (its recomputes replay its own values). A hook-only step reads
  neither: its forward draws only where the verified one did, or after a change the runtime's checks
  see (a module's number such as `self.training` or `config.layerdrop`, a global, an argument), which
  runs it verified.
- The export (`slackswap.runtime.export.replayed_state`): an eager layer seen drawing has its recompute
  run from the states before its forward; a compiled one is refused before backward.

Not seen: a forward that starts drawing on a switch none of these checks sees (for the eager export,
any change without an audit), a generator object of the model's own (`random.Random(...)`,
`numpy.random.default_rng()`), and any other number that changes outside the model (a clock, a file);
docs/runtime.md, "Numbers drawn in forward".
"""

from __future__ import annotations

import random

import numpy

#: What a forward that draws from the global generators is told (the generator named first).
_PYTHON = "Python's random module"
_NUMPY = "NumPy's global generator (numpy.random)"


def draw_states() -> tuple:
    """The states of Python's and NumPy's global generators now."""
    return random.getstate(), numpy.random.get_state()


def set_draw_states(states: tuple) -> None:
    random.setstate(states[0])
    numpy.random.set_state(states[1])


def drawn_from(before: tuple, after: tuple) -> str | None:
    """The global generator that moved between two `draw_states`, named; None when neither did."""
    (python_before, numpy_before), (python_after, numpy_after) = before, after
    if python_before != python_after:
        return _PYTHON
    if numpy_before[2:] != numpy_after[2:] or not numpy.array_equal(numpy_before[1], numpy_after[1]):
        return _NUMPY
    return None


__all__ = ["draw_states", "drawn_from", "set_draw_states"]
