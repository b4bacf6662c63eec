"""Three-way comparison (FP32 vs emulation vs native): error attributed to the format or to the kernel.

On CPU the "native" slot is filled by a deliberately broken kernel variant: a
`Numerics` whose q_proj GEMM of layer 1 is off by 25% (as a wrong scale layout
would be: the legacy `_scaled_mm` trap is off by 38-53%). The eval must blame the kernel, at exactly
that tap, while the honest emulation-vs-emulation comparison blames nothing.
"""

from __future__ import annotations

import pytest
import torch

import engine.api as api
from engine.api import Engine
from engine.loading import load_model
from engine.model import Transformer
from engine.numerics import Numerics
from evalharness.data import builtin_path
from evalharness.evals import EvalContext, run_eval
from evalharness.reference import ReferenceLM

pytestmark = pytest.mark.numerics

CFG = {"windows": 4, "seq_len": 48, "emulated": "cpu-emulated"}
BROKEN_MODULE = "layers.1.attn.q_proj"


class BrokenGemm(Numerics):
    """The emulation with one deliberately wrong GEMM (layer 1 q_proj output scaled by 1.25)."""

    def _gemm(self, xd, w, bias, module):
        y = super()._gemm(xd, w, bias, module)
        return y * 1.25 if module == BROKEN_MODULE else y


@pytest.fixture(scope="module")
def tiny():
    """tiny-llama master weights and reference."""
    loaded = load_model(str(builtin_path("tiny-llama")))
    return Transformer(loaded.cfg, loaded.weights), ReferenceLM(loaded)


@pytest.fixture()
def broken_backend(monkeypatch):
    """Register a 'cpu-broken' backend whose Numerics is `BrokenGemm`."""
    make = api.make_numerics
    monkeypatch.setattr(api, "BACKENDS", api.BACKENDS + ("cpu-broken",))
    monkeypatch.setattr(api, "make_numerics",
                        lambda recipe, backend, **kw: BrokenGemm(recipe) if backend == "cpu-broken"
                        else make(recipe, backend, **kw))
    return "cpu-broken"


def _run(tiny, recipe, native):
    model, ref = tiny
    ctx = EvalContext(engine=Engine(model, recipe), reference=ref, tokenizer=None, corpus="builtin:tiny-llama",
                      vocab_size=512, batch_size=4, seed=0, cache={}, bos_id=1)
    return run_eval("threeway", ctx, dict(CFG, native=native))


def test_broken_kernel_is_attributed_to_the_kernel_at_its_tap(tiny, broken_backend):
    """fp8-block with a broken GEMM: kernel KLD > 0, the first tap over the kernel threshold is layer 1's q."""
    m, s = _run(tiny, "fp8-block", broken_backend)
    assert m["format.kld_mean"] > 0 and m["kernel.kld_mean"] > 0
    assert s["first_kernel_tap"] == ["layers.1.attn.q"], s["first_kernel_tap"]
    assert m["tap.layers.0.attn.q.kernel_rel_l2"] == 0.0  # everything before the broken GEMM is untouched
    assert m["tap.layers.1.attn.q.kernel_rel_l2"] == pytest.approx(0.25, rel=1e-3)
    assert m["kernel.kld_mean_lo"] <= m["kernel.kld_mean"] <= m["kernel.kld_mean_hi"]


def test_fp32_with_broken_kernel_blames_the_kernel_entirely(tiny, broken_backend):
    """Under fp32 the format error is exactly 0, so all error is the kernel's (share 1, attribution kernel)."""
    m, _ = _run(tiny, "fp32", broken_backend)
    assert m["format.kld_mean"] == 0.0
    assert m["kernel.kld_mean"] > 1e-6 and m["kernel_share"] == 1.0 and m["attribution"] == 1.0
    assert m["total.kld_mean"] == pytest.approx(m["kernel.kld_mean"], rel=1e-9)


def test_identical_backends_blame_the_format_only(tiny):
    """The emulation against itself: kernel error exactly 0, no kernel tap, all error is the format's."""
    m, s = _run(tiny, "fp8-block", "cpu-emulated")
    assert m["kernel.kld_mean"] == 0.0 and m["kernel.top1_agree"] == 1.0
    assert m["format.kld_mean"] > 1e-4 and m["attribution"] == 0.0 and m["kernel_share"] == 0.0
    assert m["first_kernel_tap"] == -1.0 and s["first_kernel_tap"] == []
    assert m["total.kld_mean"] == pytest.approx(m["format.kld_mean"], rel=1e-9)


def test_unknown_backend_is_a_clear_error(tiny):
    """A misspelt backend names the setting and the choices."""
    with pytest.raises(ValueError, match="unknown backend 'cuda-nativ'"):
        _run(tiny, "fp32", "cuda-nativ")
