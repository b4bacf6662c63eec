"""One writer per results folder: an advisory lock held while a suite writes into it.

`results_lock(DIR)` takes an exclusive `flock` on ``DIR/.evalharness.lock`` without waiting. The holder writes
who it is into the file (pid, host, command, start time), so a second process is told whom it waits for::

    evalharness run suites/smoke.yaml --out results    # while another run writes to results/:
    error: results folder results is in use by another evalharness process (pid 4711 on host gpu-1, since
    2026-12-02T10:11:12+00:00: evalharness run suites/smoke.yaml --out results); wait for it to finish or write
    to another --out

The kernel drops the lock when its process ends, however it ends (kill -9 included), so a stale lock file never
blocks a later run. The lock is advisory: it keeps evalharness processes apart, not other programs.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
from pathlib import Path
from typing import Iterator

from evalharness.errors import BusyError, OutputError
from evalharness.provenance import now_iso

LOCK_NAME = ".evalharness.lock"


def _holder(fd: int) -> str:
    """Who holds the lock, from the lock file's contents."""
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        info = json.loads(os.read(fd, 1 << 16) or b"{}")
    except (OSError, ValueError):
        info = {}
    if not info.get("pid"):
        return "its details are not written yet"
    return (f"pid {info['pid']} on host {info.get('host', '?')}, since {info.get('since', '?')}: "
            f"{info.get('command', '?')}")


@contextlib.contextmanager
def results_lock(directory: str | Path, command: str | None = None) -> Iterator[Path]:
    """Hold the results folder's lock for the `with` block (creating the folder); raise `BusyError` naming the
    holder when another process holds it. `command` is recorded for that message (default: this process's
    command line)."""
    d = Path(directory)
    path = d / LOCK_NAME
    try:
        d.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as exc:
        raise OutputError(f"cannot create the lock file {path}: {exc.strerror or exc}; check the permissions of "
                          f"{d}") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise BusyError(f"results folder {d} is in use by another evalharness process ({_holder(fd)}); wait for it "
                            "to finish or write to another --out") from None
        me = {"pid": os.getpid(), "host": socket.gethostname(), "since": now_iso(),
              "command": command or " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        yield path
    finally:
        os.close(fd)  # releases the lock
