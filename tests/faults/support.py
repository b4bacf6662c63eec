"""Inputs for the fault-injection tests: tiny random models, token and text corpora, llama2.c tokenizer files and
suite files, all written into a test's tmp_path, and the CLI run in-process."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import yaml

from evalharness.cli import main
from tests.conftest import write_random_llama

VOCAB = 97  # the random llama's vocabulary (tests/conftest.py)
# Small evals: one 32-token window per tap comparison, two for PPL/KLD: a run takes well under a second.
EVALS = {"layer_error": {"windows": 1, "seq_len": 32}, "ppl_kld": {"seq_len": 32, "max_windows": 2}}


def token_corpus(path: Path, vocab: int = VOCAB, n: int = 400) -> Path:
    """A token-corpus JSON of `n` ids below `vocab`."""
    path.write_text(json.dumps({"vocab_size": vocab, "tokens": [(i * 7 + 3) % vocab for i in range(n)]}))
    return path


def llama2c_tokenizer(path: Path, n: int = VOCAB) -> Path:
    """A valid llama2.c tokenizer.bin of `n` pieces: <unk>, BOS, EOS, then single characters and pairs."""
    chars = [chr(c) for c in range(ord("a"), ord("z") + 1)] + [" ", ".", ","]
    pieces = ["<unk>", "\n<s>\n", "\n</s>\n"] + chars
    pieces += [a + b for a in " etaoin" for b in "etaoinshrdlu"][: n - len(pieces)]
    assert len(pieces) == n, len(pieces)
    data = struct.pack("<i", max(len(p.encode()) for p in pieces))
    for i, p in enumerate(pieces):
        raw = p.encode()
        data += struct.pack("<fi", -float(i), len(raw)) + raw
    path.write_bytes(data)
    return path


def text_corpus(path: Path, words: int = 2000) -> Path:
    """A plain-text corpus of lowercase words."""
    vocab = ["the", "cat", "sat", "on", "a", "mat", "and", "then", "it", "ran", "home"]
    path.write_text(" ".join(vocab[(i * 5 + i // 7) % len(vocab)] for i in range(words)) + ".\n")
    return path


def model(tmp_path: Path, name: str = "rand", seed: int = 0, **overrides) -> Path:
    """A random-init HF Llama folder (vocabulary 97 unless overridden)."""
    return write_random_llama(tmp_path / name, seed=seed, **overrides)


def write_suite(path: Path, models: list[dict], recipes=("fp32",), evals: dict | None = None,
                gate: dict | None = None, name: str = "faults") -> Path:
    """A suite file with these model entries and recipes, small evals."""
    doc = {"name": name, "models": models, "recipes": list(recipes), "evals": evals or EVALS}
    if gate is not None:
        doc["gate"] = gate
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def cli(capsys, *args: str) -> tuple[int, str]:
    """Run the evalharness CLI in this process; (exit code, stdout + stderr)."""
    code = main([str(a) for a in args])
    cap = capsys.readouterr()
    return code, cap.out + cap.err


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (bound, then released)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MlflowServer:
    """`mlflow server` on 127.0.0.1 (sqlite store `server.db` in `folder`, artifacts written by the clients to
    `folder/artifacts`, so the store can be used without the server; one worker, no job runners), in its own process
    group: `kill()` ends it at once, as a crashed server would; `stop()` always cleans up."""

    def __init__(self, folder: Path, start_s: float = 120):
        import os
        import subprocess
        import sys
        import time

        import requests

        self.store = f"sqlite:///{folder}/server.db"
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log = folder / "server.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", self.store, "--no-serve-artifacts",
                 "--default-artifact-root", (folder / "artifacts").as_uri(), "--host", "127.0.0.1",
                 "--port", self.url.rsplit(":", 1)[1], "--workers", "1"],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
        deadline = time.monotonic() + start_s
        while True:  # wait until it answers (bounded), or report why it did not
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited ({self.proc.returncode}): {self.log.read_text()[-2000:]}")
            try:
                if requests.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"mlflow server not up after {start_s} s: {self.log.read_text()[-2000:]}")
            time.sleep(0.3)

    def kill(self) -> None:
        """SIGKILL the server and its workers."""
        import os
        import signal

        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        """End the server (SIGKILL: its store is sqlite, which survives it)."""
        self.kill()
