"""A suite that needs a GPU says so. Row of the fault table: `suites/invariance-gpu.yaml` on a machine without CUDA
ended in `AssertionError: Torch not compiled with CUDA enabled`."""

from __future__ import annotations

import torch

from tests.conftest import REPO
from tests.faults.support import cli


def test_gpu_suite_without_cuda_names_the_cpu_suite_and_backend(tmp_path, capsys, monkeypatch):
    """Exit 2 before anything runs, naming the suite's backend, the CPU suite beside it and `--device cpu`."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, text = cli(capsys, "run", REPO / "suites" / "invariance-gpu.yaml", "--out", tmp_path / "out",
                     "--no-tracking")
    assert code == 2, text
    assert "needs a CUDA GPU" in text and "cuda-native" in text
    assert str(REPO / "suites" / "invariance.yaml") in text and "--device cpu" in text and "cpu-emulated" in text
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").glob("*.json"))
