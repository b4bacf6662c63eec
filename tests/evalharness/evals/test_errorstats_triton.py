"""The Triton error-statistics fold (evalharness/evals/errorstats_triton.py) against its pure-torch reference
(`fold_reference`) on the GPU: same counts and histogram, sums to float64 rounding, no host sync.

The tests marked `interpreter` (small n) also run on CPU tensors under TRITON_INTERPRET=1
(tests/support/interpret.py): one element, one partial block, bf16 input, many programs of one block, and programs of
several blocks each (ITERS > 1; there with a smaller program cap, so that a few programs reach it)."""

from __future__ import annotations

import pytest
import torch

from tests.support.interpret import GPU_TEST_DEVICE, by_device

# skipped without CUDA; under TRITON_INTERPRET=1 the tests marked `interpreter` run on the CPU (tests/conftest.py)
pytestmark = pytest.mark.gpu

DEV = GPU_TEST_DEVICE  # "cpu" under TRITON_INTERPRET=1


def _pair(n: int, seed: int, dtype=torch.float32, nonfinite: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(engine in `dtype`, reference fp32) on DEV: magnitudes over 9 decades, 1e-3 relative noise, a few inf/NaN."""
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(n, generator=g) * 10 ** (torch.rand(n, generator=g) * 9 - 6)
    e = r + 1e-3 * r.abs() * torch.randn(n, generator=g)
    if nonfinite and n > 20:
        e[5], e[11], e[17] = float("inf"), float("nan"), -float("inf")
        e[19] = r[19]  # an exact zero error
    return e.to(dtype).to(DEV), r.to(DEV)


def _fold_both(e, r, **knobs):
    """(state, hist) after folding (e, r) twice, by the kernel and by the reference."""
    from evalharness.evals.errorstats import BINS, STATE_SIZE, fold_reference
    from evalharness.evals.errorstats_triton import fold

    out = []
    for fn in (lambda *a: fold(*a, **knobs), fold_reference):
        state = torch.zeros(STATE_SIZE, dtype=torch.float64, device=e.device)
        hist = torch.zeros(BINS, dtype=torch.float64, device=e.device)
        fn(e, r, state, hist)
        fn(e, r, state, hist)
        out.append((state.cpu(), hist.cpu()))
    return out


# (n, dtype, block, program cap): 40_000 elements in blocks of 16 on the GPU's 1024 programs are 4 blocks per program
# (ITERS = 4); the interpreter reaches ITERS = 8 with 1100 elements under a cap of 16 programs
SMALL_FOLDS = ((1, torch.float32, None, None), (1000, torch.float32, None, None),
               by_device((70_001, torch.bfloat16, None, None), (9_001, torch.bfloat16, None, None)),
               by_device((40_000, torch.float32, 16, None), (1_100, torch.float32, 16, 16)))


@pytest.mark.parametrize("n,dtype,block,cap", [pytest.param(*case, marks=pytest.mark.interpreter)
                                               for case in SMALL_FOLDS] + [(3_000_000, torch.float32, None, None)])
def test_fold_kernel_matches_reference(n, dtype, block, cap, monkeypatch):
    """Counts and maxima exact, histogram equal (bin-edge ties aside: at most 2 elements moved), sums 1e-12."""
    pytest.importorskip("triton")
    if cap is not None:
        from evalharness.evals import errorstats_triton as T

        monkeypatch.setattr(T, "MAX_PROGRAMS", cap)
        monkeypatch.setattr(T, "_SCRATCH", {})  # scratch partials sized for the cap, for this test only
        blocks = -(-n // block)
        assert blocks > cap  # so every program folds several blocks
    e, r = _pair(n, seed=n, dtype=dtype)
    (sk, hk), (sr, hr) = _fold_both(e, r, block=block)
    from evalharness.evals.errorstats import COUNT, N_SUMS

    assert sk[COUNT] == sr[COUNT] == 2 * (n - (3 if n > 20 else 0))  # finite count, two folds
    assert torch.equal(sk[N_SUMS:], sr[N_SUMS:])  # maxima
    torch.testing.assert_close(sk[:N_SUMS], sr[:N_SUMS], rtol=1e-12, atol=0.0)
    assert float(hk.sum()) == float(hr.sum()) == 2 * n
    assert float((hk - hr).abs().sum()) <= 4  # two folds: an element on a bin edge moves twice


def test_accumulator_on_cuda_uses_kernel_without_sync():
    """ErrorAccumulator on CUDA tensors: the kernel path, no host synchronization in update, same results
    as kernel=False (the torch fold)."""
    pytest.importorskip("triton")
    from evalharness.evals.errorstats import ErrorAccumulator

    e, r = _pair(200_000, seed=3)
    k, t = ErrorAccumulator(), ErrorAccumulator(kernel=False)
    k.update(e, r)  # first call: compile and allocate outside the sync check
    if DEV == "cuda":
        torch.cuda.set_sync_debug_mode("error")
    try:
        k.update(e, r)
    finally:
        if DEV == "cuda":
            torch.cuda.set_sync_debug_mode("default")
    t.update(e, r)
    t.update(e, r)
    a, b = k.finite_result(), t.finite_result()  # the fold's state (result() is NaN: the pair has inf/NaN entries)
    for key in a:
        assert a[key] == pytest.approx(b[key], rel=1e-10), key
    assert a["nonfinite_frac"] == pytest.approx(3 / 200_000)


@pytest.mark.interpreter
def test_fold_rejects_bad_input():
    pytest.importorskip("triton")
    from evalharness.evals.errorstats_triton import fold

    e, r = _pair(64, seed=1)
    state = torch.zeros(8, dtype=torch.float64, device=e.device)
    with pytest.raises(ValueError, match="hist must be a contiguous"):
        fold(e, r, state, torch.zeros(719, dtype=torch.float64, device=e.device))
    with pytest.raises(ValueError, match="power of two"):
        fold(e, r, state, torch.zeros(720, dtype=torch.float64, device=e.device), block=100)
