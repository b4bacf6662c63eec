"""Harness errors. Each is bad input (CLI exit code 2) with a message that names
the file / key / tensor and says what to do."""

from engine.errors import EngineError


class HarnessError(Exception):
    """Base class: bad input to the harness (exit code 2)."""

    exit_code = 2


class SuiteError(HarnessError):
    """A suite YAML is malformed or names something that does not exist."""


class DataError(HarnessError):
    """The data dir or a corpus / task file is missing or unreadable."""


class ResultError(HarnessError):
    """A result or baseline file is corrupt or of another schema version."""


class OutputError(HarnessError):
    """A result cannot be written (disk full, read-only or missing permissions): nothing is half-written."""


class BusyError(HarnessError):
    """Another process is writing to the same results folder."""


class PartlyRunError(HarnessError):
    """An eval ran what it could on this model and not the rest (e.g. a generating task on a layer-streamed model).

    Carries the `metrics` and `samples` of what ran: the runner keeps them in the result, runs the run's other evals,
    and ends the run as an error (bad input) whose message names what did not run and why."""

    def __init__(self, message: str, metrics: dict, samples: dict):
        super().__init__(message)
        self.metrics, self.samples = metrics, samples


# Every exception type that means 'bad input' (exit code 2), harness and engine alike (the engine's checkpoint and
# tokenizer errors are EngineErrors).
BAD_INPUT: tuple[type[BaseException], ...] = (HarnessError, EngineError, FileNotFoundError)
