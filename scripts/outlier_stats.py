"""Activation statistics of a model and of its `outliers:` variant (engine.outliers), and the proof that the
variant computes the same function in FP32.

For each model folder it runs the FP32 reference (HF transformers) on windows of the model's held-out sample and
prints, per layer:

* every GEMM input (each nn.Linear's input: q/k/v or the MLA down projections, o_proj, gate/up, down, router,
  shared experts): max over channels of the channel's max |x| over tokens, divided by the median over channels
  (routed experts are a fused module that hooks do not see: their inputs are the MoE block's input, listed as
  the router's);
* the KV cache: per KV head max |K| and max |V| (k_proj / v_proj outputs), as largest head / median head and
  largest / smallest; for MLA the cached latent's channel ratio (the kv_b_proj input);
* the FP32 logits of the variant vs the original, by the reference and by the engine's fp32 recipe:
  max |difference| and relative L2.

    python scripts/outlier_stats.py zoo/zoo-llama zoo/zoo-moe [--windows 8 --seq-len 128]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

import torch


def _windows(folder: Path, n: int, seq_len: int) -> torch.Tensor:
    """(n, seq_len) token windows from the folder's heldout_sample.json."""
    toks = json.loads((folder / "heldout_sample.json").read_text())["tokens"]
    assert len(toks) >= n * seq_len, f"{folder}: held-out sample has {len(toks)} tokens, need {n * seq_len}"
    return torch.tensor(toks[: n * seq_len]).view(n, seq_len)


def _collect(reference, tokens: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Per nn.Linear: each input channel's max |x| over all tokens (`name/in`) and, for k/v projections, each
    output channel's (`name/out`); and the logits."""
    amax: dict[str, torch.Tensor] = {}
    hooks = []

    def keep(key: str, x: torch.Tensor) -> None:
        a = x.detach().abs().reshape(-1, x.shape[-1]).amax(0)  # (channels,)
        amax[key] = a if key not in amax else torch.maximum(amax[key], a)

    for name, mod in reference.model.named_modules():
        if isinstance(mod, torch.nn.Linear):
            hooks.append(mod.register_forward_pre_hook(lambda m, args, n=name: keep(n + "/in", args[0])))
            if name.endswith(("k_proj", "v_proj", "kv_a_proj_with_mqa")):
                hooks.append(mod.register_forward_hook(lambda m, args, out, n=name: keep(n + "/out", out)))
    with torch.no_grad():
        logits = reference.model(tokens).logits
    for h in hooks:
        h.remove()
    return amax, logits


def _ratio(a: torch.Tensor) -> float:
    """max / median of per-channel (or per-head) maxima."""
    return float(a.max() / a.median())


def _heads(a: torch.Tensor, hd: int) -> torch.Tensor:
    """Per-head maxima of per-channel maxima (channels grouped by head_dim)."""
    return a.view(-1, hd).amax(1)


def _engine_logits(loaded, tokens: torch.Tensor) -> torch.Tensor:
    """The engine's logits under the fp32 recipe."""
    from engine.api import Engine
    from engine.model import Transformer

    return Engine(Transformer(loaded.cfg, loaded.weights, where=loaded.source), "fp32").logits(tokens)


def _rows(cfg, amax: dict[str, torch.Tensor]) -> dict[str, dict[str, float]]:
    """{'layers.i': {column: ratio}} for the table."""
    out: dict[str, dict[str, float]] = defaultdict(dict)
    for key, a in amax.items():
        name, kind = key.rsplit("/", 1)
        if not name.startswith("model.layers."):
            continue
        layer = ".".join(name.split(".")[1:3])
        short = name.split(".", 3)[3].replace("self_attn.", "").replace("mlp.", "").replace("shared_experts.", "sh.")
        if kind == "in":
            out[layer][short] = _ratio(a)
        elif cfg.mla is None:  # k_proj / v_proj outputs: per KV head
            h = _heads(a, cfg.head_dim)
            out[layer][short.replace("_proj", "") + " head max/med"] = _ratio(h)
            out[layer][short.replace("_proj", "") + " head max/min"] = float(h.max() / h.min())
    return out


def report(folder: Path, windows: int, seq_len: int) -> str:
    """The statistics of one model folder and its outliers: variant, as text."""
    from engine.loading import load_model
    from evalharness.reference import ReferenceLM

    tokens = _windows(folder, windows, seq_len)
    lines = [f"## {folder.name}: {windows} windows x {seq_len} tokens of heldout_sample.json, FP32 reference"]
    res = {}
    for label, source in (("original", str(folder)), ("outliers", "outliers:" + str(folder))):
        loaded = load_model(source)
        amax, logits = _collect(ReferenceLM(loaded), tokens)
        res[label] = (loaded, _rows(loaded.cfg, amax), logits, _engine_logits(loaded, tokens))
    cfg = res["original"][0].cfg
    o, v = res["original"][1], res["outliers"][1]
    lines.append("per GEMM input: max over channels of max|x| / median over channels (original -> outliers)")
    cols = sorted({c for row in o.values() for c in row if "head" not in c})
    for layer in sorted(o, key=lambda s: int(s.split(".")[1])):
        cells = [f"{c} {o[layer][c]:.3g}->{v[layer][c]:.3g}" for c in cols if c in o[layer]]
        lines.append(f"  {layer}: " + ", ".join(cells))
    if cfg.mla is None:
        lines.append(f"per KV head ({cfg.num_kv_heads} heads of {cfg.head_dim}): max|K|, max|V| largest head / median "
                     "head, largest / smallest (original -> outliers)")
        for layer in sorted(o, key=lambda s: int(s.split(".")[1])):
            cells = [f"{c} {o[layer][c]:.3g}->{v[layer][c]:.3g}" for c in sorted(o[layer]) if "head" in c]
            lines.append(f"  {layer}: " + ", ".join(cells))
    else:
        lines.append("MLA: the K cache is one rope head (per-head = per-tensor); the latent cache's channel ratio is "
                     "the kv_b_proj input above")
    for how, idx in (("FP32 reference (HF transformers)", 2), ("engine, fp32 recipe", 3)):
        a, b = res["original"][idx], res["outliers"][idx]
        rel = float((a - b).norm() / a.norm())
        lines.append(f"logits, outliers vs original, {how}: max |diff| {float((a - b).abs().max()):.3g} "
                     f"(max |logit| {float(a.abs().max()):.3g}), rel L2 {rel:.3g}")
    meds = [statistics.median(r[c] for r in d.values() if c in r) for d in (o, v) for c in ("down_proj",)
            if any(c in r for r in d.values())]
    if len(meds) == 2:
        lines.append(f"down_proj input, median over layers: {meds[0]:.3g} -> {meds[1]:.3g}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Print the report of each model folder."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folders", nargs="+", type=Path)
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    args = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    from engine.outliers import DEFAULT_PLAN

    print(f"# scripts/outlier_stats.py, torch {torch.__version__}, plan {DEFAULT_PLAN}")
    for folder in args.folders:
        print(report(folder, args.windows, args.seq_len))
        print()


if __name__ == "__main__":
    main()
