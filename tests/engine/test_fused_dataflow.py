"""The fused producers' quantizations travel as values: `rmsnorm_quant`, `residual_norm` and `swiglu` return the
QTensor they computed, the model hands it to the `act_quant` (or `lm_head`) of exactly those values, and nothing is
kept on the backend between calls. Checked on the CPU with a backend whose producers return the library's
quantization (what the native fused kernels return bit for bit): the logits equal the emulation's, and every
GEMM input that follows a norm or SwiGLU took the producer's QTensor."""

from __future__ import annotations

import collections

import pytest
import torch

from engine.formats import QTensor, parse_spec, quantize
from engine.loading import load_model
from engine.model import Transformer
from engine.numerics import Numerics
from engine.recipe import load_recipe
from evalharness.data import builtin_path


class FusingNumerics(Numerics):
    """The emulation whose norm / SwiGLU producers also return their quantization to the recipe's GEMM input
    format, as the native fused kernels do; `act_quant` returns a producer's QTensor when the spec matches and
    counts what it took."""

    def __init__(self, recipe):
        super().__init__(recipe)
        self.taken: collections.Counter[str] = collections.Counter()
        self.made = 0

    def _fused(self, values: torch.Tensor) -> QTensor:
        self.made += 1
        return quantize(values, self.recipe.spec("linear.input"))

    def rmsnorm_quant(self, x, weight, eps, module):
        hn = self.rmsnorm(x, weight, eps, module)
        return hn, self._fused(hn)

    def swiglu(self, gate, up, module):
        act, none = super().swiglu(gate, up, module)
        assert none is None
        return act, self._fused(act)

    def act_quant(self, x, module, site="linear.input", fused=None):
        spec = self.recipe.spec(site, module)
        if fused is not None and fused.shape == x.shape and fused.spec == parse_spec(spec):
            self.taken[module.split(".", 2)[-1]] += 1
            return fused
        return super().act_quant(x, module, site)


@pytest.mark.parametrize("recipe, head", [("fp8-block", None), ("mxfp8", None), ("fp8-block", "e4m3:128x128")])
def test_fused_quantizations_reach_their_gemms(recipe, head):
    recipe = load_recipe(recipe) if head is None else load_recipe(recipe).derive("quantized-head", lm_head=head)
    loaded = load_model(str(builtin_path("tiny-llama")))
    model = Transformer(loaded.cfg, loaded.weights)
    tokens = torch.randint(0, loaded.cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    emu = Numerics(recipe)
    want = model.forward(emu, model.prepare(emu), tokens)
    fz = FusingNumerics(recipe)
    got = model.forward(fz, model.prepare(fz), tokens)
    assert torch.equal(got, want)  # the producers' QTensors are the consumers' quantization, bit for bit
    layers = loaded.cfg.num_layers
    # attn_norm -> q/k/v, mlp_norm -> gate/up, SwiGLU -> down_proj per layer; the final norm -> a quantized head
    want_taken = {"attn.qkv": layers, "mlp.gate_up": layers, "mlp.down_proj": layers}
    if head is not None:
        want_taken["lm_head"] = 1
    assert fz.taken == want_taken, fz.taken
    assert fz.made == 3 * layers + 1
