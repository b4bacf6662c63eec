"""MLP blocks: the dense SwiGLU MLP and the MoE block (router + routed experts + optional shared expert).

The routed part runs through the `Numerics.moe` dispatch point (router in the
`router` precision, experts at the `moe.weight` / `moe.input` sites). The
shared expert is *not* routed: it runs on every token through the ordinary
dense path (`linear.*` sites) -- with Qwen2-MoE's sigmoid gate, computed in the
`router` precision -- and is added to the routed sum.
"""

from __future__ import annotations

from typing import Mapping

import torch

from engine.config import ModelConfig
from engine.formats import QTensor
from engine.numerics import Numerics


def swiglu_mlp(nx: Numerics, w: Mapping[str, torch.Tensor], hq: QTensor, prefix: str, module: str,
               act_tap: str | None) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)) for the quantized input `hq`; weights under `prefix` (HF), paths under `module`.

    Emits `act_tap` (the SwiGLU output as read by down_proj) when given.
    """
    g, u = nx.linears(hq, [w[prefix + "gate_proj.weight"], w[prefix + "up_proj.weight"]],
                      [w.get(prefix + "gate_proj.bias"), w.get(prefix + "up_proj.bias")],
                      [module + ".gate_proj", module + ".up_proj"])
    act, fused = nx.swiglu(g, u, module)
    aq = nx.act_quant(act, module + ".down_proj", fused=fused)  # fused SwiGLU -> quant
    if act_tap is not None and nx.tapping:
        nx.emit(act_tap, aq.dequantize())
    return nx.linear(aq, w[prefix + "down_proj.weight"], w.get(prefix + "down_proj.bias"), module + ".down_proj")


def dense_block(nx: Numerics, w: Mapping[str, torch.Tensor], i: int, hn: torch.Tensor,
                fused: QTensor | None = None) -> torch.Tensor:
    """The dense MLP of layer `i` on the normed input (batch, t, d) (`fused`: the norm's own quantization of it,
    `Numerics.rmsnorm_quant`); emits mlp_norm, mlp.act, mlp.out."""
    p, tp = f"model.layers.{i}.", f"layers.{i}."
    hq = nx.act_quant(hn, tp + "mlp.gate_up", fused=fused)  # fused RMSNorm -> quant, shared by gate/up
    if nx.tapping:
        nx.emit(tp + "mlp_norm", hq.dequantize())
    m = swiglu_mlp(nx, w, hq, p + "mlp.", tp + "mlp", tp + "mlp.act")
    nx.emit(tp + "mlp.out", m)
    return m


def moe_block(nx: Numerics, w: Mapping[str, torch.Tensor], cfg: ModelConfig, i: int,
              hn: torch.Tensor) -> torch.Tensor:
    """The MoE MLP of layer `i` on the normed input hn (batch, t, d) -> (batch, t, d).

    Emits mlp_norm (the experts' input after `moe.input` quantization),
    moe.router_logits, moe.topk (from `Numerics.moe`), moe.shared (shared
    expert output before its gate) and mlp.out (routed + gated shared).
    """
    moe = cfg.moe
    assert moe is not None
    p, tp = f"model.layers.{i}.", f"layers.{i}."
    b, t, d = hn.shape
    flat = hn.reshape(b * t, d)  # (tokens, d)
    xq = nx.act_quant(flat, tp + "mlp.experts", site="moe.input")  # quantized once, before dispatch
    if nx.tapping:
        nx.emit(tp + "mlp_norm", xq.dequantize().reshape(b, t, d))
    experts = [(w[f"{p}mlp.experts.{e}.gate_proj.weight"], w[f"{p}mlp.experts.{e}.up_proj.weight"],
                w[f"{p}mlp.experts.{e}.down_proj.weight"]) if f"{p}mlp.experts.{e}.gate_proj.weight" in w
               else None for e in range(moe.num_experts)]  # None: held by another rank (expert parallelism)
    y = nx.moe(flat, xq, w[p + "mlp.gate.weight"], w.get(p + "mlp.gate.e_score_correction_bias"), experts, moe,
               tp + "mlp", tp)  # (tokens, d)
    if moe.shared_intermediate_size:
        name = "shared_expert" if moe.shared_gate else "shared_experts"
        hq = nx.act_quant(flat, f"{tp}mlp.{name}.gate_up")  # the shared expert's own linear.input quantization
        s = swiglu_mlp(nx, w, hq, f"{p}mlp.{name}.", f"{tp}mlp.{name}", None)  # (tokens, d)
        nx.emit(tp + "moe.shared", s)  # (tokens, d)
        if moe.shared_gate:
            g = nx.router(flat, w[p + "mlp.shared_expert_gate.weight"], tp + "mlp.shared_expert_gate")  # (tokens, 1)
            s = torch.sigmoid(g) * s
        y = y + s
    out = y.reshape(b, t, d)  # (batch, t, d)
    nx.emit(tp + "mlp.out", out)
    return out
