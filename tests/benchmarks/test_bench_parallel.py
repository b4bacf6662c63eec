"""benchmarks/bench_parallel.py checks itself on CPU (2 gloo ranks, the emulation, a small Qwen3-MoE shape): EP=2 is
bit-identical to one process and decodes its tokens, each layout's pages hold its KV heads, and only layouts with
expert parallelism send expert rows."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_bench_parallel_on_cpu(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(port), "benchmarks/bench_parallel.py", "--model", "tiny-moe", "--layers", "2",
           "--device", "cpu", "--windows", "2", "--seq-len", "64", "--batch", "3", "--prompt", "16", "--steps", "4",
           "--work", str(tmp_path / "work"), "--out", str(tmp_path / "out")]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {(r["tp"], r["ep"]): r for r in json.loads((tmp_path / "out" / "bench_parallel.json").read_text())["rows"]}
    assert set(rows) == {(1, 2), (2, 1), (2, 2)}
    assert rows[(1, 2)]["bitwise"] and rows[(1, 2)]["token_agreement"] == 1.0
    assert [rows[k]["kv_heads_per_rank"] for k in ((1, 2), (2, 1), (2, 2))] == [2, 1, 1]
    assert rows[(1, 2)]["ep_bytes_per_step_rank"] > 0 and rows[(2, 2)]["ep_bytes_per_step_rank"] > 0
    assert rows[(2, 1)]["ep_bytes_per_step_rank"] == 0
    assert all(r["kld_mean"] < 1e-3 and r["step_ms"] > 0 for r in rows.values())
    assert "tp  ep" in (tmp_path / "out" / "bench_parallel.txt").read_text()
