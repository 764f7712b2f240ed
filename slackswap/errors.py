"""Exceptions shared by all stages.

Every error names the offending field (or tensor/op) and value, so a user can fix the config or plan
without reading our code.
"""


class SlackSwapError(Exception):
    """Base class for every error the library raises on purpose."""


class ConfigError(SlackSwapError, ValueError):
    """A model, hardware or budget value that makes no sense (names the field and the value)."""

    def __init__(self, field: str, value: object, why: str):
        self.field = field
        self.value = value
        self.why = why
        super().__init__(f"{field}={value!r}: {why}")


def reject_unknown_fields(section: str, data: object, known: object) -> None:
    """Raise a ConfigError naming the section and every key of `data` that is not in `known`.

    Config mappings are turned into dataclasses with `cls(**data)`; a typo must name the key, not
    surface as a TypeError about an unexpected keyword argument.
    """
    unknown = sorted(set(data) - set(known))  # type: ignore[call-overload]
    if unknown:
        raise ConfigError(section, unknown, "unknown field(s)")


class FileFormatError(SlackSwapError, ValueError):
    """A file that is not what its name says (truncated by a full disk, hand-edited, another schema):
    the message names the path and what is wrong, in one line."""


def read_json_file(path: object, what: str) -> object:
    """`json.loads` of the file at `path`; invalid JSON is a `FileFormatError` naming the file (a bare
    `JSONDecodeError` names only a line and a column)."""
    import json
    from pathlib import Path

    try:
        return json.loads(Path(path).read_text())  # type: ignore[arg-type]
    except json.JSONDecodeError as exc:
        raise FileFormatError(
            f"{path}: not a valid {what} ({exc.msg} at line {exc.lineno}, column {exc.colno}; truncated?)"
        ) from None


class PlanValidationError(SlackSwapError):
    """A plan that is not a complete, consistent schedule. The message names the first inconsistency."""


class SolverError(SlackSwapError):
    """A solver (HiGHS) failed or returned an unusable answer: a failure of the run, not a verdict on
    the budget (an `InfeasibleBudgetError` is reserved for budgets shown not to fit)."""


class GraphMismatchError(PlanValidationError):
    """A plan made for one graph given with another: its graph fingerprint differs (names both)."""


class InfeasibleBudgetError(SlackSwapError):
    """A planner cannot meet the budget. This is a recorded outcome of a run, not a crash.

    It carries no floor: the least budget a planner meets is found by the experiment layer
    (`slackswap.experiment.floor`), by bisection, not guessed from the last candidate tried.
    """

    def __init__(self, reason: str):
        self.reason = reason
        super().__init__(reason)
