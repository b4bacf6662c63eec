"""A plain-text progress bar on stderr (no dependency), driven by the runner's log lines.

The runner logs one line per finished run, starting with ``[n/total]``.
`ProgressLog` is a drop-in `log` callable: it prints every message as before
and, after each ``[n/total]`` line, a bar with the elapsed time and an ETA::

    [n/total] zoo-llama__fp8-block__default__cpu-emulated: ok in 2.8s
    progress [#########...........]  9/20 runs  45%  elapsed 0:41  eta 0:50

On a terminal the bar is redrawn in place (carriage return); in a log file
(CI) it is one ordinary line per update.
"""

from __future__ import annotations

import re
import sys
import time
from typing import TextIO

_STEP = re.compile(r"^\[(\d+)/(\d+)\]")


def _clock(seconds: float) -> str:
    """H:MM:SS or M:SS."""
    s = int(round(max(seconds, 0.0)))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m}:{sec:02d}"


def bar(done: int, total: int, elapsed: float, width: int = 20, unit: str = "runs",
        timed_done: int | None = None) -> str:
    """One progress line; the ETA extrapolates the mean time of the runs done in this process.

    `timed_done` is how many of `done` were actually run here (resumed runs take
    no time and must not shorten the ETA); defaults to `done`.
    """
    total = max(total, 1)
    filled = min(width, int(width * done / total))
    timed = done if timed_done is None else timed_done
    left = total - done
    eta = _clock(elapsed / timed * left) if timed > 0 and left > 0 else ("0:00" if left == 0 else "?")
    return (f"progress [{'#' * filled}{'.' * (width - filled)}] {done:>{len(str(total))}}/{total} {unit} "
            f"{100 * done / total:3.0f}%  elapsed {_clock(elapsed)}  eta {eta}")


class ProgressLog:
    """A `log` callable for `run_suite`: passes messages through and draws a progress bar after `[n/total]` lines."""

    def __init__(self, stream: TextIO | None = None, unit: str = "runs"):
        self.stream = stream if stream is not None else sys.stderr
        self.unit = unit
        self.t0 = time.time()
        self.skipped = 0
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._live: str | None = None  # the bar currently drawn in place (terminal only)

    def __call__(self, message: str) -> None:
        """Print `message`; update the bar when it reports a finished run."""
        if self._live:
            self.stream.write("\r\033[K")  # erase the live bar; it is redrawn below the message
        self.stream.write(message + "\n")
        m = _STEP.match(message)
        if m:
            done, total = int(m.group(1)), int(m.group(2))
            if "already finished" in message:
                self.skipped += 1
            line = bar(done, total, time.time() - self.t0, unit=self.unit, timed_done=done - self.skipped)
            if self.tty and done < total:
                self._live = line
            else:
                self._live = None
                self.stream.write(line + "\n")
        if self._live:
            self.stream.write(self._live)
        self.stream.flush()
