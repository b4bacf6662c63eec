"""Provenance: git SHA, package versions, hardware fingerprint, content hashes."""

from __future__ import annotations

import datetime as _dt
import hashlib
import importlib.metadata
import os
import platform
import subprocess
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


REPO_ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("torch", "transformers", "safetensors", "numpy", "scipy", "triton", "lm_eval", "mlflow", "datasets",
            "evalharness")


@lru_cache(maxsize=1)
def git_sha() -> str:
    """The harness checkout's HEAD commit (with '-dirty' when the tree has changes), or 'unknown'."""
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        if not sha:
            return "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


@lru_cache(maxsize=1)
def package_versions() -> dict[str, str]:
    """Installed versions of the packages that can change numerics or results."""
    out = {}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name.replace("_", "-"))
        except importlib.metadata.PackageNotFoundError:
            continue
    out["python"] = platform.python_version()
    return out


def _cpu_model() -> str:
    """CPU model name from /proc/cpuinfo (Linux) or platform.processor()."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@lru_cache(maxsize=4)
def hardware_fingerprint(device: str = "cpu") -> dict[str, Any]:
    """What the numbers were measured on: CPU, and GPU name / capability / driver / CUDA / cuBLAS when used."""
    import torch

    fp: dict[str, Any] = {
        "device": device,
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "hardware_class": "cpu",
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        idx = torch.device(device).index or 0
        props = torch.cuda.get_device_properties(idx)
        fp.update({
            "gpu": props.name,
            "compute_capability": f"{props.major}.{props.minor}",
            "gpu_memory_gib": round(props.total_memory / 2**30, 1),
            "cuda": torch.version.cuda,
            "cublas": getattr(torch._C, "_cublas_version", lambda: None)() if hasattr(torch._C, "_cublas_version") else None,
            "hardware_class": props.name.replace("NVIDIA ", "").replace(" ", "-").lower(),
        })
        try:
            fp["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                          capture_output=True, text=True, timeout=10).stdout.strip().splitlines()[0]
        except (OSError, subprocess.SubprocessError, IndexError):
            fp["driver"] = None
        try:
            import triton

            fp["triton"] = triton.__version__
        except ImportError:
            pass
    return fp


def sha256_bytes(data: bytes) -> str:
    """Hex sha256 of bytes."""
    return hashlib.sha256(data).hexdigest()


def sha256_tensor(t: torch.Tensor) -> str:
    """Hex sha256 of a tensor's values (contiguous, on CPU) and shape."""
    import torch

    t = t.detach().contiguous().cpu()
    h = hashlib.sha256(str(tuple(t.shape)).encode() + str(t.dtype).encode())
    h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def now_iso() -> str:
    """Current UTC time, ISO 8601."""
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
