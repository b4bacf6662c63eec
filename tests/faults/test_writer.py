"""The results folder under faults. Rows of the fault table:

* two `evalharness run` processes on the same --out: no lock before (results of two configurations mixed);
* SIGTERM: exit 143 with no message and the mlflow parent run left RUNNING before;
* result and baseline files: mode 0600 whatever the umask before;

and a full disk for the results folder (simulated): the write fails cleanly, names the file, keeps every finished
result, and `--resume` completes the suite once there is space.
"""

from __future__ import annotations

import errno
import os
import signal
import stat
import subprocess
import sys
import threading

import pytest

from evalharness.results import load_result
from tests.conftest import REPO
from tests.faults.support import cli, model, token_corpus, write_suite

FP32, BF16 = "m__fp32__default__cpu-emulated.json", "m__bf16__default__cpu-emulated.json"


@pytest.fixture
def suite(tmp_path):
    """One model under fp32 and bf16."""
    entry = {"name": "m", "path": str(model(tmp_path, "m")), "corpus": str(token_corpus(tmp_path / "c.json"))}
    return write_suite(tmp_path / "s.yaml", [entry], recipes=("fp32", "bf16"))


def test_second_writer_gets_an_error_naming_the_holder(suite, tmp_path, capsys):
    """While another process holds the results folder, `run` (and `log`) exit 2 naming its pid and command, and
    write nothing; once it is gone the run goes ahead."""
    out = tmp_path / "out"
    code = ("import sys\nfrom evalharness.lock import results_lock\n"
            "with results_lock(sys.argv[1], command='evalharness run other.yaml'):\n"
            "    print('held', flush=True)\n    sys.stdin.read()\n")
    holder = subprocess.Popen([sys.executable, "-c", code, str(out)], cwd=REPO, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        rc, text = cli(capsys, "run", suite, "--out", out, "--no-tracking")
        assert rc == 2, text
        assert f"results folder {out} is in use" in text and f"pid {holder.pid}" in text
        assert "evalharness run other.yaml" in text
        assert not list(out.glob("*.json"))
        rc, text = cli(capsys, "log", out)
        assert rc == 2 and f"pid {holder.pid}" in text
    finally:
        holder.stdin.close()
        holder.wait()
    assert cli(capsys, "run", suite, "--out", out, "--no-tracking")[0] == 0
    assert load_result(out / BF16)["status"] == "ok"


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_files_get_the_umask_permissions(suite, tmp_path, capsys, umask):
    """Result, suite.json and baseline files are created with 0666 minus the umask (0644 under 022)."""
    old = os.umask(umask)
    try:
        out, base = tmp_path / "out", tmp_path / "base"
        assert cli(capsys, "run", suite, "--out", out, "--no-tracking", "--set", "recipe=fp32")[0] == 0
        assert cli(capsys, "baseline", "update", out, "--baselines", base)[0] == 0
    finally:
        os.umask(old)
    want = 0o666 & ~umask
    for path in (out / FP32, out / "suite.json", base / "faults" / FP32):
        assert stat.S_IMODE(path.stat().st_mode) == want, (path, oct(path.stat().st_mode))


@pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy:DeprecationWarning")
def test_sigterm_is_handled_like_ctrl_c(suite, tmp_path, capsys, monkeypatch):
    """SIGTERM during the second run: exit 143 with a message, the first result kept, no temporary file, and no
    mlflow run left RUNNING (the parent is KILLED)."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers need the main thread")
    pytest.importorskip("mlflow")
    import evalharness.runner as runner
    from mlflow.tracking import MlflowClient

    from evalharness import tracking

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    real, calls = runner.run_eval, {"n": 0}

    def terminated_midway(name, ctx, cfg):
        calls["n"] += 1
        if calls["n"] == 3:  # the first eval of the second run
            os.kill(os.getpid(), signal.SIGTERM)
        return real(name, ctx, cfg)

    monkeypatch.setattr(runner, "run_eval", terminated_midway)
    out = tmp_path / "out"
    before = signal.getsignal(signal.SIGTERM)
    code, text = cli(capsys, "run", suite, "--out", out)
    assert code == 143, text
    assert "terminated (SIGTERM)" in text and "--resume" in text
    assert load_result(out / FP32)["status"] == "ok" and not (out / BF16).exists()
    assert not list(out.glob(".*.tmp"))
    assert signal.getsignal(signal.SIGTERM) == before  # the previous handler is back
    client = MlflowClient(tracking.default_tracking_uri(out))
    runs = client.search_runs([client.get_experiment_by_name("evalharness-faults").experiment_id])
    status = {r.data.tags.get("kind"): r.info.status for r in runs}
    assert status == {"suite": "KILLED", "result": "FINISHED"}, status


def test_full_disk_keeps_finished_results_and_resume_completes(suite, tmp_path, capsys, monkeypatch):
    """The disk fills up while the second result is written (fsync fails with ENOSPC): exit 2 naming the file and
    the cause, the first result intact, no partial or temporary file; with space again `--resume` completes."""
    out = tmp_path / "out"
    real, calls = os.fsync, {"n": 0}

    def fsync(fd):
        calls["n"] += 1
        if calls["n"] == 3:  # suite.json, the first result, then the second
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    code, text = cli(capsys, "run", suite, "--out", out, "--no-tracking")
    monkeypatch.setattr(os, "fsync", real)
    assert code == 2, text
    assert f"cannot write {out / BF16}" in text and "No space left on device" in text and "--resume" in text
    first = (out / FP32).stat().st_mtime_ns
    assert load_result(out / FP32)["status"] == "ok" and not (out / BF16).exists()
    assert not list(out.glob(".*.tmp"))
    code, text = cli(capsys, "run", suite, "--out", out, "--no-tracking", "--resume")
    assert code == 0, text
    assert load_result(out / BF16)["status"] == "ok" and (out / FP32).stat().st_mtime_ns == first
