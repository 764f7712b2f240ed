"""Interrupts and fatal errors of the command-line tools, turned into one line and an exit code.

Why this module exists: Hydra catches every `Exception` of a task or a callback and prints a
traceback (or, from a callback, only a warning, and the sweep goes on). Two kinds of events must not
look like that:

- an interrupt (Ctrl-C = SIGINT, or SIGTERM from a scheduler or `kill`): the in-flight MLflow runs
  and the sweep's parent run are marked KILLED, the partial summary is written, and the process
  exits 130 (SIGINT) or 143 (SIGTERM) with one line;
- an error that the user fixes in the config or the environment (a value out of range, a corrupt
  tracking store, an unreachable server): one line naming the field and value, or the URI or path.

Both travel as `BaseException` subclasses, which Hydra's handlers let through, up to `run_cli`.
Errors Hydra raises itself (an unknown preset, a misspelt key, a value of the wrong type, a folder it
cannot write) are turned into the same one line while `run_cli` runs (`hydra_errors_as_one_line`):
Hydra's own report is several lines and, for a misspelt key, suggests `+key=...`, which fails again
on the typed schema. Whatever ends the process early (an `Abort`, an unexpected error), the runs this
process still has open are ended FAILED first, so nothing is left RUNNING.
`HYDRA_FULL_ERROR=1` keeps the full traceback of the underlying error, as Hydra does.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import errno
import gc
import io
import os
import re
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from pipelines.records import RunStatus


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived. A KeyboardInterrupt, so libraries that clean up on Ctrl-C (joblib)
    do the same for SIGTERM."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class Abort(BaseException):
    """A fatal error already explained in `message` (one line): print it, exit with `code`."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


def full_error() -> bool:
    """Did the user ask for full tracebacks (HYDRA_FULL_ERROR=1)? Inside `hydra_errors_as_one_line`,
    which sets the variable itself, the user's own setting answers."""
    return os.environ.get(_USER_FULL_ERROR, os.environ.get("HYDRA_FULL_ERROR")) == "1"


@dataclass
class InFlightRun:
    client: Any
    run_id: str


#: MLflow runs this process has started and not yet ended (a job's run, a sweep's parent run), so an
#: interrupt that lands anywhere (even inside MLflow's own calls) can still mark them KILLED.
IN_FLIGHT: dict[str, InFlightRun] = {}


#: MLflow runs this process ended KILLED (by the interrupt handler, or by a job that caught the
#: interrupt itself and marked its own run), so the interrupt line counts every one of them.
KILLED_RUN_IDS: set[str] = set()
#: The output folder of the single run, training or advice in progress: the interrupt line names it.
OUTPUT_DIR: Path | None = None


def note_output_dir(path: Path) -> None:
    global OUTPUT_DIR
    OUTPUT_DIR = Path(path)


def interrupted_tail() -> str:
    """What an interrupt line of a single run adds: how many MLflow runs ended KILLED (its own, ended
    by the job, included) and where its output folder is."""
    tail = f"; {len(KILLED_RUN_IDS)} MLflow run(s) marked KILLED"
    return tail + (f"; output in {OUTPUT_DIR}" if OUTPUT_DIR is not None else "")


def track_in_flight(client: Any, run_id: str) -> None:
    IN_FLIGHT[run_id] = InFlightRun(client, run_id)


def done_in_flight(run_id: str) -> None:
    IN_FLIGHT.pop(run_id, None)


def release_interrupted_frames(exc: BaseException) -> None:
    """Let go of the frames an interrupt unwound, before the tracking store is written again.

    Why: the interrupt may land inside a store write, between a statement and its commit. The unwound
    frames, kept alive by the exception's traceback while its handler runs, still hold that
    SQLAlchemy connection and with it SQLite's write lock, so marking the run KILLED from the
    handler waited out the busy timeout and failed ("database is locked"), leaving the run RUNNING.
    Dropping the tracebacks (of the exception and of those it was raised during) frees the frames;
    the connection pool then rolls the orphaned connection back. The collection breaks the cycles
    frames and exceptions often form."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        current.__traceback__ = None
        current = current.__context__ or current.__cause__
    gc.collect()


def kill_run(client: Any, run_id: str, status: RunStatus = RunStatus.KILLED, reason: str = "") -> None:
    """End one run KILLED (or FAILED), with the tag status=killed (failed) and, when given, `reason`
    (best effort: the interrupt or the fault may have hit the store itself)."""
    try:
        client.set_tag(run_id, "status", str(status))
        if reason:
            client.set_tag(run_id, "reason", reason[:4000])
        client.set_terminated(run_id, status="KILLED" if status == RunStatus.KILLED else "FAILED")
        if status == RunStatus.KILLED:
            KILLED_RUN_IDS.add(run_id)
    except Exception as exc:
        print(f"warning: could not mark MLflow run {run_id} {status.upper()}: {exc}", file=sys.stderr)
    done_in_flight(run_id)


def kill_in_flight_run(run_id: str) -> None:
    """Mark `run_id` KILLED if this process still has it open."""
    run = IN_FLIGHT.get(run_id)
    if run is not None:
        kill_run(run.client, run_id)


def kill_in_flight_except(keep: str | None, status: RunStatus = RunStatus.KILLED, reason: str = "") -> int:
    """End every run this process still has open, but `keep`, as KILLED (or FAILED); returns how many."""
    marked = 0
    for run in [r for r in IN_FLIGHT.values() if r.run_id != keep]:
        kill_run(run.client, run.run_id, status, reason)
        marked += 1
    return marked


def fail_in_flight(reason: str) -> int:
    """End every run this process still has open FAILED with `reason`; returns how many."""
    return kill_in_flight_except(None, RunStatus.FAILED, reason)


# ------------------------------------------------------------------ errors raised by Hydra itself

#: Exit code of a config mistake (a bad value, an unknown preset, a misspelt key), as argparse uses.
EXIT_CONFIG_ERROR = 2


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0].strip() if text else type(exc).__name__


def message_line(exc: BaseException) -> str:
    """The first line of `exc`'s message, with the next one joined on when it ends in a colon (a
    heading such as Hydra's `In 'model/typo': ConfigKeyError raised while composing config:`)."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    if lines[0].endswith(":") and len(lines) > 1:
        return f"{lines[0]} {lines[1]}"
    return lines[0]


def os_error_path(exc: OSError) -> str | None:
    """The file an OSError is about: its `filename`, or, for a failed `write()` (which names no file:
    a full disk), the file open for writing in the innermost frame that holds one."""
    if exc.filename:
        return str(exc.filename)
    frames = []
    tb = exc.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    for frame in reversed(frames):
        for value in frame.f_locals.values():
            if not isinstance(value, io.IOBase):
                continue
            name, mode = getattr(value, "name", None), getattr(value, "mode", "")
            if isinstance(name, str) and isinstance(mode, str) and set(mode) & set("wax+"):
                return name
    return None


def os_error_line(exc: OSError) -> str:
    """`No space left on device: outputs/.../graph.json (ENOSPC)`: the cause and the path."""
    name = errno.errorcode.get(exc.errno or 0, "")
    what = exc.strerror or first_line(exc)
    path = os_error_path(exc)
    where = f": {path}" if path else ""
    return f"{what}{where}" + (f" ({name})" if name else "")


def describe_os_error(exc: BaseException) -> str | None:
    """One line for an OSError anywhere in `exc`'s chain, or None."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, OSError):
            return os_error_line(current)
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def hydra_error_line(exc: BaseException) -> str | None:
    """One line for a config mistake Hydra reports (composition, override syntax), or None.

    - unknown preset: `model=gpt5: no such preset (conf/model/gpt5.yaml); known: bert_large, ...`
    - misspelt key: `budget.fracton: no such key in budget; known: bytes, device, fraction, reserve_bytes`
    - wrong type: `model.num_layers: Value 'three' of type 'str' could not be converted to Integer`
    No `+key=` hint: every node is a typed schema, so appending a key fails the same way.
    """
    from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException

    if isinstance(exc, MissingConfigException) and exc.missing_cfg_file and "/" in exc.missing_cfg_file:
        group, _, name = exc.missing_cfg_file.rpartition("/")
        known = f"; known: {', '.join(exc.options)}" if exc.options else ""
        return f"{group}={name}: no such preset (conf/{group}/{name}.yaml){known}"
    if isinstance(exc, OverrideParseException):
        return f"override: {first_line(exc)}"
    if not isinstance(exc, ConfigCompositionException):
        return None
    # Hydra raises the composition error of a preset file (`In 'model/typo': ConfigKeyError raised
    # while composing config:`) inside the handler of omegaconf's error without `from`: the cause is
    # the context, and the first line of the message ends at the colon before omegaconf's text.
    cause = exc.__cause__ or exc.__context__
    key = getattr(cause, "full_key", None)
    if cause is None or not key:
        return message_line(exc)
    cause_line = first_line(cause)
    # The preset file the mistake is in (`In 'model/typo': ...`), when a file rather than the command line.
    preset = re.match(r"In '([^']+)':", str(exc).strip())
    where = f" (in preset {preset.group(1)})" if preset else ""
    if type(cause).__name__ in ("ConfigKeyError", "ConfigAttributeError"):
        node, _, leaf = str(key).rpartition(".")
        schema = getattr(cause, "object_type", None)
        known = ""
        if schema is not None and dataclasses.is_dataclass(schema):
            known = "; known: " + ", ".join(sorted(f.name for f in dataclasses.fields(schema)))
        if leaf:
            return f"{key}{where}: no such key in {node or 'the config'} ({cause_line}){known}"
        return f"{key}{where}: {cause_line}"
    return f"{key}{where}: {cause_line}"


def one_line_for(exc: Exception) -> Abort:
    """The one-line `Abort` for an error Hydra raised, or one of the task's own errors."""
    line = hydra_error_line(exc)
    if line is not None:
        return Abort(f"error: {line}", code=EXIT_CONFIG_ERROR)
    os_line = describe_os_error(exc)
    if os_line is not None:
        return Abort(f"error: {os_line}", code=1)
    return Abort(f"error: {type(exc).__name__}: {first_line(exc)}", code=1)


#: What the user's own HYDRA_FULL_ERROR was while `hydra_errors_as_one_line` sets it (an environment
#: variable, not a global, so a launcher's worker processes read it too).
_USER_FULL_ERROR = "SLACKSWAP_USER_HYDRA_FULL_ERROR"


@contextmanager
def hydra_errors_as_one_line() -> Iterator[None]:
    """Hydra's own errors (composition, overrides, a folder it cannot write) as one line.

    Hydra prints an error and exits 1 unless HYDRA_FULL_ERROR=1 is set, in which case it raises it
    (its documented switch for a full traceback). The switch is set while the block runs, so the error
    arrives here as an exception, through Hydra's public behaviour only; `full_error()` still answers
    what the user asked for, and a user who set HYDRA_FULL_ERROR=1 gets the traceback."""
    if _USER_FULL_ERROR in os.environ:  # nested (a test calling one CLI from another)
        yield
        return
    os.environ[_USER_FULL_ERROR] = os.environ.get("HYDRA_FULL_ERROR", "")
    previous = os.environ.get("HYDRA_FULL_ERROR")
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        yield
    except Exception as exc:
        if full_error():
            raise
        abort = one_line_for(exc)
        raise abort from (exc if abort.code == 1 and describe_os_error(exc) is None else None)
    finally:
        del os.environ[_USER_FULL_ERROR]
        if previous is None:
            os.environ.pop("HYDRA_FULL_ERROR", None)
        else:
            os.environ["HYDRA_FULL_ERROR"] = previous


def _raise_interrupted(signum: int, frame: Any) -> None:
    raise Interrupted(signum)


@contextmanager
def signals_raise_interrupted() -> Iterator[None]:
    """SIGINT and SIGTERM raise `Interrupted` in the main thread while the block runs."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, _raise_interrupted) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextmanager
def signals_ignored() -> Iterator[None]:
    """Clean-up after an interrupt runs to its end: a second Ctrl-C must not leave runs RUNNING."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def close_failed_default(exc: Abort) -> str:
    """After a fatal error: the runs this process still has open end FAILED. Returns what to add to
    the line ("" when nothing was open)."""
    marked = fail_in_flight(exc.message.removeprefix("error: "))
    return f"; {marked} MLflow run(s) marked FAILED" if marked else ""


def run_cli(
    main: Callable[[], Any],
    on_interrupt: Callable[[Interrupted], str],
    exit_code: Callable[[], int],
    on_abort: Callable[[Abort], str] = close_failed_default,
) -> int:
    """Run a Hydra main; turn interrupts, `Abort` and Hydra's own errors into one line on stderr and
    an exit code.

    `on_interrupt` cleans up (marks runs KILLED, writes the partial summary) and returns the line to
    print; `on_abort` ends what is still open FAILED and returns what to add to the error's line;
    `exit_code` is asked after a normal return (non-zero when a sweep had failed jobs).
    """
    global OUTPUT_DIR
    KILLED_RUN_IDS.clear()
    OUTPUT_DIR = None
    try:
        with signals_raise_interrupted(), hydra_errors_as_one_line():
            main()
    except Abort as exc:
        with signals_ignored():
            tail = on_abort(exc)
        print(exc.message + tail, file=sys.stderr)
        return exc.code
    except KeyboardInterrupt as exc:
        interrupted = exc if isinstance(exc, Interrupted) else Interrupted(signal.SIGINT)
        with signals_ignored():
            release_interrupted_frames(exc)
            line = on_interrupt(interrupted)
        print(line, file=sys.stderr)
        return interrupted.exit_code
    except Exception as exc:  # HYDRA_FULL_ERROR=1: the traceback follows, nothing is left RUNNING
        with signals_ignored():
            on_abort(Abort(f"error: {type(exc).__name__}: {first_line(exc)}"))
        raise
    return exit_code()


def exit_process(code: int) -> NoReturn:
    """End the command-line process with `code` once its work is done, without the interpreter's teardown.

    Why: freeing the objects of every imported module one by one (mlflow alone imports thousands)
    took 0.6-0.9 s after a single run had finished, a fifth of its time, for memory the OS reclaims
    anyway. What an exit must do is still done, in the same order as a normal exit: the atexit
    handlers run (logging flushes and closes its handlers, multiprocessing joins its children,
    MLflow's hooks), then stdout and stderr are flushed. Every file of a run is written and closed,
    and every MLflow write committed, before the CLI returns its code. With other threads alive
    (a launcher's pool) the normal exit is kept: it joins them before the atexit handlers.
    """
    if threading.active_count() > 1:
        sys.exit(code)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed pipe: nothing left to say
            stream.flush()
    os._exit(code)
