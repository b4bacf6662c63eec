"""SwiGLU+quant on strided gate / up views, on the CPU under the Triton interpreter (a helper script).

    TRITON_INTERPRET=1 python tests/interpret_swiglu_strided.py

`tests/test_swiglu_strided.py` runs it in a subprocess (the interpreter is chosen when the kernels are decorated,
so it needs a fresh process). The native backend hands `engine.kernels.quant.swiglu_quant` the two column halves
of the stacked gate/up GEMM's output, which the kernel reads at their row stride: each check compares those
bits (FP8 data, scales, fp32 activation) with the same kernel on contiguous copies of the same values. Exit
status 0: every check printed "ok NAME"; anything else: a failure.
"""

from __future__ import annotations

import sys
from pathlib import Path

CHECKS = ("stacked_halves_2d", "stacked_halves_3d", "bf16_halves", "mixed_dtypes", "column_strided_copy", "knobs",
          "mismatch_refused")


def _gemm_like(rows: int, k: int, dtype, seed: int):
    """A (rows, 2K) GEMM-like output with zeros, tiny, huge, NaN and +-inf entries in the gate half."""
    import torch

    g = torch.Generator().manual_seed(seed)
    y = torch.randn(rows, 2 * k, generator=g) * 4
    y[0, :k] = 0.0
    y[-1, 5] = float("nan")
    y[-1, 7] = float("inf")
    y[-1, 9] = -float("inf")
    y[min(1, rows - 1), 130:140] = 1e-40
    y[min(1, rows - 1), 3] = 1e30
    return y.to(dtype)


def _same(a, b, what: str) -> None:
    import torch

    if a.dtype == torch.float8_e4m3fn:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    elif a.dtype == torch.float32:
        a, b = a.view(torch.int32), b.view(torch.int32)
    assert a.shape == b.shape, f"{what}: shapes {tuple(a.shape)} vs {tuple(b.shape)}"
    bad = int((a != b).sum())
    assert bad == 0, f"{what}: {bad} of {a.numel()} differ"


def _check_pair(gate, up, **knobs) -> None:
    from engine.kernels.quant import swiglu_quant

    d, s, h = swiglu_quant(gate, up, return_hp=True, **knobs)
    rd, rs, rh = swiglu_quant(gate.contiguous(), up.contiguous(), return_hp=True, **knobs)
    assert d.shape == gate.shape and h.shape == gate.shape and s.shape == (*gate.shape[:-1], gate.shape[-1] // 128)
    _same(d, rd, "FP8 data")
    _same(s, rs, "scales")
    _same(h, rh, "fp32 activation")


def run(name: str) -> None:
    import torch

    k = 256
    if name == "stacked_halves_2d":
        y = _gemm_like(5, k, torch.float32, 0)
        gate, up = y.split([k, k], dim=-1)
        assert not gate.is_contiguous() and gate.stride(0) == 2 * k
        _check_pair(gate, up)
    elif name == "stacked_halves_3d":  # decode: (batch, 1 token, 2K)
        y = _gemm_like(3, k, torch.float32, 1).reshape(3, 1, 2 * k)
        gate, up = y.split([k, k], dim=-1)
        _check_pair(gate, up)
    elif name == "bf16_halves":
        y = _gemm_like(4, k, torch.bfloat16, 2)
        gate, up = y.split([k, k], dim=-1)
        _check_pair(gate, up)
    elif name == "mixed_dtypes":  # an fp32 gate half with a bf16 up tensor: each is read in its own dtype
        y = _gemm_like(4, k, torch.float32, 6)
        gate, up = y[:, :k], y[:, k:].to(torch.bfloat16)
        _check_pair(gate, up)
    elif name == "column_strided_copy":  # columns not contiguous: the wrapper copies, same bits
        y = _gemm_like(4, k, torch.float32, 3)
        gate, up = y[:, 0::2], y[:, 1::2]
        assert gate.stride(-1) == 2
        _check_pair(gate, up)
    elif name == "knobs":  # row tiles that straddle the rows, several groups per program
        y = _gemm_like(7, k, torch.float32, 4)
        gate, up = y.split([k, k], dim=-1)
        _check_pair(gate, up, bm=4, gb=2, num_warps=2)
        _check_pair(gate, up, bm=1, gb=1)
    elif name == "mismatch_refused":
        from engine.kernels.quant import swiglu_quant

        y = _gemm_like(4, k, torch.float32, 5)
        for g, u in ((y[:, :k], y[:3, k:]), (y[:, :k], y[:, k:k + 128])):
            try:
                swiglu_quant(g, u)
            except ValueError as e:
                assert "gate" in str(e) and "up" in str(e), e
            else:
                raise AssertionError(f"gate {tuple(g.shape)} {g.dtype} / up {tuple(u.shape)} {u.dtype} accepted")
    else:
        raise KeyError(name)


def main(names: list[str]) -> int:
    here = Path(__file__).resolve().parent
    sys.path[:0] = [str(here.parent), str(here)]
    from interpret_util import script_main

    return script_main(names, CHECKS, run, loop_bounds=False)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
