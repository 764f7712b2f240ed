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

The generator objects the model's modules hold as attributes (`self.rng = random.Random(0)`,
`numpy.random.default_rng()`, a `RandomState`; `own_generators`) are read and restored with these two.

The generators are process-wide: another thread drawing from them while a verified forward runs (a
data-loading thread of the training loop) reads as the forward's draw, which costs the hook-only steps
(every step then runs verified: slower, exact) and is named in the refusal.

Not seen: a forward that starts drawing on a switch none of these checks sees (for the eager export,
any change without an audit), a generator object held elsewhere (a module global, a config object) or a
`random.SystemRandom` (no state), and any other number that changes outside the model (a clock, a file);
docs/runtime.md, "Numbers drawn in forward".
"""

from __future__ import annotations

import pickle
import random

import numpy

#: What a forward that draws from the global generators is told (the generator named first).
_PYTHON = "Python's random module"
_NUMPY = "NumPy's global generator (numpy.random)"
#: Generator objects a model's module may hold and draw from (`random.SystemRandom` has no state to read).
_GENERATOR_KINDS = (random.Random, numpy.random.Generator, numpy.random.RandomState)


def own_generators(model: object) -> tuple[tuple[str, object], ...]:
    """The generator objects the modules of `model` (a `torch.nn.Module`) hold as attributes (`self.rng =
    random.Random(0)`, `numpy.random.default_rng()`), each with its module path and attribute name."""
    return tuple((f"{path}.{key}" if path else key, value) for path, module in model.named_modules()
                 for key, value in module.__dict__.items()
                 if isinstance(value, _GENERATOR_KINDS) and not isinstance(value, random.SystemRandom))


def _state(generator: object) -> object:
    if isinstance(generator, random.Random):
        return generator.getstate()
    if isinstance(generator, numpy.random.Generator):
        return generator.bit_generator.state
    return generator.get_state()


def _set_state(generator: object, state: object) -> None:
    if isinstance(generator, random.Random):
        generator.setstate(state)
    elif isinstance(generator, numpy.random.Generator):
        generator.bit_generator.state = state
    else:
        generator.set_state(state)


def draw_states(own: tuple = ()) -> tuple:
    """The states of Python's and NumPy's global generators now, and of the model's own (`own_generators`)."""
    return random.getstate(), numpy.random.get_state(), tuple([_state(g) for _, g in own])


def set_draw_states(states: tuple, own: tuple = ()) -> None:
    random.setstate(states[0])
    numpy.random.set_state(states[1])
    for (_, generator), state in zip(own, states[2], strict=True):
        _set_state(generator, state)


def drawn_from(before: tuple, after: tuple, own: tuple = ()) -> str | None:
    """The generator that moved between two `draw_states`, named; None when none did."""
    (python_before, numpy_before, own_before), (python_after, numpy_after, own_after) = before, after
    if python_before != python_after:
        return _PYTHON
    if numpy_before[2:] != numpy_after[2:] or not numpy.array_equal(numpy_before[1], numpy_after[1]):
        return _NUMPY
    for (label, generator), state_before, state_after in zip(own, own_before, own_after, strict=True):
        if pickle.dumps(state_before) != pickle.dumps(state_after):  # states hold arrays: compared as bytes
            return f"the model's own generator {label} ({type(generator).__name__})"
    return None


__all__ = ["draw_states", "drawn_from", "own_generators", "set_draw_states"]
