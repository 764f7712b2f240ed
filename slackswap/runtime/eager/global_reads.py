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

How: while the model's forward runs in a verified step, a global trace function (`sys.settrace`, on the
step's thread, called at each Python call only, and chained to a tracer already set: a debugger's, or
coverage's) sees each Python function called; it costs that step 30-45 %. The first time a code object is
seen, its bytecode names the globals it loads (`LOAD_GLOBAL x`, and the attributes and constant
subscripts read right after: `x.y.z`, `x["k"]`, a list's `x[0]`), and the entries holding a plain value
become slots (the modules, plain objects, classes of the user's, dicts and lists on the way too, by
identity); so do the cells of its closure that hold one (the function found among the garbage
collector's referrers of the code, by the cells' contents: a decorator's wrapper is one code for many
functions). A hook-only step reads
the slots again (25-40 on the zoo's Llama, GPT-2, T5 and Mixtral: 2.1-3.1 us) and runs verified,
recording them again, when any differs. Functions of torch's and this package's own modules are
skipped (their globals reflect the dispatch modes a verified step runs under), and so are the garbage
collector's callbacks, which a collection inside the forward runs.

Not seen: a property, a subscript by a variable (`TABLE[k]`) or
more than `CHAIN_DEPTH` accesses down, and a closure made after its code was first seen with another one
(a closure's cells are looked up once per code object in the process); docs/runtime.md, "Hook-only
steps".
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
#: The key of a slot that is a closure cell.
_CELL = object()
#: Per code object: the globals its bytecode loads, each with the accesses read right after it (an attribute
#: name, or ("item", key) for a constant subscript); computed once per process.
_LOADS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
#: Per code object with free variables: the plain-valued cells of the function first seen running it.
_CELLS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
#: How far down a chain of accesses a slot is followed (`SETTINGS.train.lr` is two).
CHAIN_DEPTH = 3


def _loads(code: types.CodeType) -> tuple[tuple[str, tuple], ...]:
    """The globals a code object loads, each with the chain of attributes and constant subscripts read
    right after it (`CFG.train.t` is ("CFG", ("train", "t")); `CONF["t"]` is ("CONF", (("item", "t"),)))."""
    found = _LOADS.get(code)
    if found is not None:
        return found
    names: list[tuple[str, tuple]] = []
    instructions = list(dis.get_instructions(code))
    for i, ins in enumerate(instructions):
        if ins.opname != "LOAD_GLOBAL":
            continue
        chain: list[object] = []
        j = i + 1
        while j < len(instructions) and len(chain) < CHAIN_DEPTH:
            now = instructions[j]
            if now.opname in ("LOAD_ATTR", "LOAD_METHOD") and isinstance(now.argval, str):
                chain.append(now.argval)
                j += 1
            elif (now.opname == "LOAD_CONST" and j + 1 < len(instructions)
                  and instructions[j + 1].opname == "BINARY_SUBSCR" and type(now.argval) in PLAIN):
                chain.append(("item", now.argval))
                j += 2
            else:
                break
        names.append((ins.argval, tuple(chain)))
    found = tuple(names)
    _LOADS[code] = found
    return found


def _is_plain_object(value: object) -> bool:
    """An object whose attributes are data: a module, or an instance with a `__dict__` that is not a class
    or a callable (a settings object, a config)."""
    if isinstance(value, types.ModuleType):
        return not value.__name__.startswith(_SKIPPED_PREFIXES)
    return type(getattr(value, "__dict__", None)) is dict and not callable(value) and not isinstance(value, type)


def _is_namespace_class(value: object) -> bool:
    """A class of the user's used as a namespace of settings (`class Settings: temperature = 2.0`), read
    through its attributes and its bases' (builtins' and torch's classes are not)."""
    return isinstance(value, type) and value.__module__ != "builtins" and not value.__module__.startswith(
        _SKIPPED_PREFIXES)


def _closure_cells(frame: types.FrameType, code: types.CodeType) -> tuple[tuple[str, types.CellType], ...]:
    """The plain-valued cells of the function a frame runs: among the functions with its code (a
    decorator's wrapper is one code for every function it wraps), those whose cells hold what the frame
    reads."""
    local = frame.f_locals
    wanted = [local.get(name, _MISSING) for name in code.co_freevars]
    if not any(type(value) in PLAIN for value in wanted):
        return ()
    found: list[tuple[str, types.CellType]] = []
    for owner in gc.get_referrers(code):
        cells = owner.__closure__ if type(owner) is types.FunctionType and owner.__code__ is code else None
        if not cells or len(cells) != len(wanted):
            continue
        if all(_contents(cell) is value for cell, value in zip(cells, wanted, strict=True)):
            found += [(name, cell) for name, cell, value in zip(code.co_freevars, cells, wanted, strict=True)
                      if type(value) in PLAIN]
    return tuple(found)


def _contents(cell: types.CellType) -> object:
    try:
        return cell.cell_contents
    except ValueError:
        return _MISSING


def _get(holder: object, key: object) -> object:
    """What a slot holds now: a closure cell's contents, a list's item, or a dict's entry."""
    if key is _CELL:
        return _contents(holder)
    if type(holder) is list:
        return holder[key] if -len(holder) <= key < len(holder) else _MISSING
    return holder.get(key, _MISSING)


def first_change(slots: tuple, values: tuple) -> str | None:
    """The first slot (a dict entry, a list item, or a closure cell) that holds another value than it held, named; None
    when none does. A plain value is compared by type and value, any other object by identity (no `__eq__`
    of a user's object is called)."""
    for (holder, key, label), before in zip(slots, values, strict=True):
        now = _get(holder, key)
        if now is not before and not (type(now) in PLAIN and type(now) is type(before) and now == before):
            return label
    return None


class GlobalReads:
    """While started, on this thread: the plain values the Python functions called read from their module
    globals and closures (`slots`, `values`, in the order first read)."""

    def __init__(self) -> None:
        self.slots: list[tuple[object, object, str]] = []
        self.values: list[object] = []
        self._seen_codes: set[types.CodeType] = set()
        self._seen_slots: set[tuple[int, object]] = set()
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
        module = scope.get("__name__", "?")
        for name, chain in _loads(code):
            self._follow(scope, name, chain, f"{module}.{name}")
        if code.co_freevars:
            self._closure(frame, code)

    def _follow(self, table: dict, key: object, chain: tuple, label: str) -> None:
        """Slots along `table[key]` and the accesses after it: a plain value ends the chain as a slot; a
        module, a plain object or a dict on the way is a slot too (by identity: another object in its place
        runs the step verified), and the chain goes on into its attributes or items."""
        value = _get(table, key)
        if type(value) in PLAIN:
            self._add(table, key, value, label)
            return
        if not chain:
            return
        access, rest = chain[0], chain[1:]
        if type(access) is tuple and (type(value) is dict or (type(value) is list and type(access[1]) is int)):
            self._add(table, key, value, label)
            self._follow(value, access[1], rest, f"{label}[{access[1]!r}]")
        elif type(access) is str and _is_plain_object(value):
            self._add(table, key, value, label)
            self._follow(value.__dict__, access, rest, f"{label}.{access}")
        elif type(access) is str and _is_namespace_class(value):
            self._add(table, key, value, label)
            for cls in value.__mro__[:-1]:  # its own attributes, then its bases' (up to `object`)
                if access in cls.__dict__:
                    self._follow(cls.__dict__, access, rest, f"{label}.{access}")
                    break
                self._add(cls.__dict__, access, _MISSING, f"{label}.{access}")  # one set there later shadows

    def _closure(self, frame: types.FrameType, code: types.CodeType) -> None:
        """The plain-valued cells of the function called: among the functions with this code (a decorator's
        wrapper is one code for every function it wraps), those whose cells hold what the frame reads."""
        cells = _CELLS.get(code)
        if cells is None:  # once per code object in the process: the referrers' walk reads every object
            cells = _CELLS[code] = _closure_cells(frame, code)
        for name, cell in cells:
            value = _contents(cell)
            if type(value) in PLAIN:
                self._add(cell, _CELL, value, f"{name!r} of the closure {code.co_qualname}")

    def _add(self, holder: object, key: object, value: object, label: str) -> None:
        if (id(holder), key) in self._seen_slots:
            return
        self._seen_slots.add((id(holder), key))
        self.slots.append((holder, key, label))
        self.values.append(value)


__all__ = ["GlobalReads", "PLAIN", "first_change"]
