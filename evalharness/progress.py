"""Progress of a suite run on stderr, drawn by tqdm.

On a terminal: a bar over the suite's runs, one over the evals of the run in progress and one inside each eval
(windows, lm-eval requests, generation requests), each with its rate and ETA; lm-eval's own bars (request
building) stack under them, since lm-eval draws with tqdm too. Log lines are written above the bars.

Off a terminal (a CI log, a pipe) no bar is drawn: one line per finished step, the eval of a run and the run,
the run's line with the suite's elapsed time, ETA and rate::

    [1/4] tiny-llama__fp32__default__cpu-emulated: layer_error done in 0.3s (1/2 evals)
    [1/4] tiny-llama__fp32__default__cpu-emulated: ppl_kld done in 0.5s (2/2 evals)
    [1/4] tiny-llama__fp32__default__cpu-emulated: ok in 0.9s (1/4 runs, elapsed 00:01, eta 00:03, 1.02s/run)

`Progress()` is the `log` callable of `evalharness.runner.run_suite` as well as its `progress`; a
`Progress(bars=False)` (the runner's default) writes no bars and leaves every line to the runner's `log`.
"""

from __future__ import annotations

import contextlib
import io
import sys
from typing import Iterable, Iterator, TextIO

from tqdm import tqdm

# The suite's progress in a finished run's line (non-terminal output): tqdm's own elapsed / ETA / rate fields.
STEP_METER = "{n_fmt}/{total_fmt} {unit}s, elapsed {elapsed}, eta {remaining}, {rate_fmt}"


class Progress:
    """Bars on `stream` (default stderr) when it is a terminal and `bars` is on; plain lines otherwise."""

    def __init__(self, stream: TextIO | None = None, bars: bool = True):
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bars and bool(getattr(self.stream, "isatty", lambda: False)())
        self._runs: tqdm | None = None

    def __call__(self, message: str) -> None:
        """Write one log line (above the bars on a terminal)."""
        if self.tty:
            tqdm.write(message, file=self.stream)
        else:
            self.stream.write(message + "\n")
            self.stream.flush()

    def bar(self, iterable: Iterable | None = None, total: int | None = None, desc: str = "",
            unit: str = "it", leave: bool = False) -> tqdm:
        """A tqdm bar over `iterable` (or updated by hand up to `total`), drawn on a terminal only."""
        return tqdm(iterable, total=total, desc=desc, unit=unit, leave=leave, file=self.stream,
                    disable=not self.tty, dynamic_ncols=True, smoothing=0.1)

    @contextlib.contextmanager
    def runs(self, total: int, finished: int = 0) -> Iterator[None]:
        """The suite's bar for the block: `total` runs, `finished` of them done before (resumed: they do not count
        in the rate). Off a terminal the bar writes nowhere and only lends its clock to `run_done`."""
        self._runs = tqdm(total=total, initial=finished, unit="run", desc="suite", smoothing=0, leave=True,
                          file=self.stream if self.tty else io.StringIO(), dynamic_ncols=True,
                          mininterval=0 if self.tty else float("inf"))
        try:
            yield
        finally:
            self._runs.close()
            self._runs = None

    def run_done(self) -> str:
        """Count one finished run on the suite's bar; returns the suite's meter for the run's line
        (`STEP_METER`; empty outside `runs`)."""
        if self._runs is None:
            return ""
        self._runs.update(1)
        d = self._runs.format_dict
        return tqdm.format_meter(**{**d, "bar_format": STEP_METER}).replace("  ", " ")

    @contextlib.contextmanager
    def evals(self, key: str, names: list[str]) -> Iterator[tqdm]:
        """The bar over one run's evals (update it after each)."""
        with self.bar(total=len(names), desc=key, unit="eval") as b:
            yield b


def no_bars() -> Progress:
    """A Progress that draws nothing and writes nothing: every line goes to the caller's own `log`."""
    return Progress(io.StringIO(), bars=False)
