"""The Python values from outside the model that its forward reads: module globals and closure cells
holding numbers, strings or None (`GlobalReads`), what a recomputing plan's hook-only step compares with
the verified step's before running on hooks alone.

Why: a recompute on hooks alone replays the verified step's recorded ATen calls with their Python
values. The module checks (`eager.module_calls.ModuleState`) see the numbers the modules and their
config objects hold, and the arguments the model is called with; a number from anywhere else came back
as the verified step's. Measured before this check: `h / TEMPERATURE`, a module global the training loop
lowered from 2.0 to 1.5, gave a silently wrong gradient on every hook-only step after the change, as did
`h / settings.TEMPERATURE` (an attribute of an imported module), an attribute of a global object, and a
`nonlocal` number of a closure the forward calls.

How: while the model's forward runs in a verified step, a profile function (`sys.setprofile`, on the
step's thread, chained to any profiler already set) sees each Python function called. The first time
a code object is seen, its bytecode names the globals it loads (`LOAD_GLOBAL x`, and `x.y` where `x`
is a module or a plain object), and those holding a plain value become slots; so do the cells of its
closure that hold one (the function found among the garbage collector's referrers of the code, by the
cells' contents: a decorator's wrapper is one code for many functions). A hook-only step reads the
slots again (14-15 on the zoo's Llama, GPT-2, T5 and Mixtral: 0.7 us) and runs verified, recording them
again, when any differs. Functions of torch's and this package's own modules are skipped: their globals
reflect the dispatch modes a verified step runs under; so are the garbage collector's callbacks, which a
collection inside the forward runs.

Not seen: a value read through a class attribute, a property, a container (`CONFIG["t"]`) or two
attributes down, and a closure made after its code was first seen with another one (a closure's cells
are looked up once per code object in the process); docs/runtime.md, "Hook-only steps".
"""

from __future__ import annotations

import dis
import gc
import sys
import threading
import types
import weakref
from collections.abc import Callable

#: The value types a slot compares: what a Python number or switch is.
PLAIN = (int, float, bool, str, type(None), complex)
#: Modules whose functions are not read: torch (its globals follow the dispatch modes) and this package.
_SKIPPED_PREFIXES = ("torch", "slackswap")
_MISSING = object()
#: Per code object: the (global, attribute or None) pairs its bytecode loads; computed once per process.
_LOADS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
#: Per code object with free variables: the plain-valued cells of the function first seen running it.
_CELLS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _loads(code: types.CodeType) -> tuple[tuple[str, str | None], ...]:
    """The globals a code object loads, each with the attribute read right after it (or None)."""
    found = _LOADS.get(code)
    if found is not None:
        return found
    names: list[tuple[str, str | None]] = []
    instructions = list(dis.get_instructions(code))
    for i, ins in enumerate(instructions):
        if ins.opname != "LOAD_GLOBAL":
            continue
        after = instructions[i + 1] if i + 1 < len(instructions) else None
        attribute = after.argval if after is not None and after.opname in ("LOAD_ATTR", "LOAD_METHOD") else None
        names.append((ins.argval, attribute if isinstance(attribute, str) else None))
    found = tuple(names)
    _LOADS[code] = found
    return found


def _is_plain_object(value: object) -> bool:
    """An object whose attributes are data: a module, or an instance with a `__dict__` that is not a class
    or a callable (a settings object, a config)."""
    if isinstance(value, types.ModuleType):
        return not value.__name__.startswith(_SKIPPED_PREFIXES)
    return type(getattr(value, "__dict__", None)) is dict and not callable(value) and not isinstance(value, type)


def _closure_cells(frame: types.FrameType, code: types.CodeType) -> tuple[types.CellType, ...]:
    """The plain-valued cells of the function a frame runs: among the functions with its code (a
    decorator's wrapper is one code for every function it wraps), those whose cells hold what the frame
    reads."""
    local = frame.f_locals
    wanted = [local.get(name, _MISSING) for name in code.co_freevars]
    if not any(type(value) in PLAIN for value in wanted):
        return ()
    found: list[types.CellType] = []
    for owner in gc.get_referrers(code):
        cells = owner.__closure__ if type(owner) is types.FunctionType and owner.__code__ is code else None
        if not cells or len(cells) != len(wanted):
            continue
        if all(_contents(cell) is value for cell, value in zip(cells, wanted, strict=True)):
            found += [cell for cell, value in zip(cells, wanted, strict=True) if type(value) in PLAIN]
    return tuple(found)


def _contents(cell: types.CellType) -> object:
    try:
        return cell.cell_contents
    except ValueError:
        return _MISSING


def read(slots: tuple) -> tuple:
    """The values the slots hold now (a dict entry, or a closure cell)."""
    return tuple([_contents(holder) if key is None else holder.get(key, _MISSING) for holder, key in slots])


class GlobalReads:
    """While started, on this thread: the plain values the Python functions called read from their module
    globals and closures (`slots`, `values`, in the order first read)."""

    def __init__(self) -> None:
        self.slots: list[tuple[object, str | None]] = []
        self.values: list[object] = []
        self._seen_codes: set[types.CodeType] = set()
        self._seen_slots: set[tuple[int, str | None]] = set()
        self._thread = threading.get_ident()
        self._previous: Callable | None = None
        self._active = False

    def start(self) -> None:
        if self._active or threading.get_ident() != self._thread:
            return
        self._previous = sys.gettrace()
        self._active = True
        # A garbage collection inside the forward runs the gc callbacks, which are no part of it (Hypothesis
        # times each collection in its module's globals: read as the forward's, they differed every step).
        self._seen_codes.update(c for c in (getattr(cb, "__code__", None) for cb in gc.callbacks) if c is not None)
        sys.settrace(self._trace)

    def stop(self, *_: object) -> None:
        if not self._active:
            return
        self._active = False
        sys.settrace(self._previous)
        self._previous = None

    def _trace(self, frame: types.FrameType, event: str, arg: object) -> Callable | None:
        """The global trace function: called at each Python call only (no local tracing of ours), and
        handing each call to the tracer set before (a debugger, coverage), whose local tracer it returns."""
        local = self._previous(frame, event, arg) if self._previous is not None else None
        code = frame.f_code
        if code not in self._seen_codes:
            self._seen_codes.add(code)
            self._read(frame, code)
        return local

    def _read(self, frame: types.FrameType, code: types.CodeType) -> None:
        scope = frame.f_globals
        if str(scope.get("__name__", "")).startswith(_SKIPPED_PREFIXES):
            return
        for name, attribute in _loads(code):
            value = scope.get(name, _MISSING)
            if type(value) in PLAIN:
                self._add(scope, name, value)
            elif attribute is not None and _is_plain_object(value):
                table = value.__dict__
                if type(table.get(attribute, _MISSING)) in PLAIN:
                    self._add(table, attribute, table[attribute])
        if code.co_freevars:
            self._closure(frame, code)

    def _closure(self, frame: types.FrameType, code: types.CodeType) -> None:
        """The plain-valued cells of the function called: among the functions with this code (a decorator's
        wrapper is one code for every function it wraps), those whose cells hold what the frame reads."""
        cells = _CELLS.get(code)
        if cells is None:  # once per code object in the process: the referrers' walk reads every object
            cells = _CELLS[code] = _closure_cells(frame, code)
        for cell in cells:
            value = _contents(cell)
            if type(value) in PLAIN:
                self._add(cell, None, value)

    def _add(self, holder: object, key: str | None, value: object) -> None:
        if (id(holder), key) in self._seen_slots:
            return
        self._seen_slots.add((id(holder), key))
        self.slots.append((holder, key))
        self.values.append(value)


__all__ = ["GlobalReads", "PLAIN", "read"]
