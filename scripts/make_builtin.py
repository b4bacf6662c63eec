"""Generate the built-in synthetic model `evalharness/builtin/tiny-llama` and its token corpus.

The built-in lets `suites/smoke.yaml` run on a fresh machine with no data
dir and no network. It is a deterministic, seeded Llama (dim 128, 4 layers,
GQA 4/2 heads, SwiGLU 384, vocab 512) whose weights imitate what makes real
LLMs hard to quantize: a few "massive activation" channels in the residual
stream, RMSNorm gains with outlier channels, and heavy-tailed (Student-t)
weights. Its corpus is sampled from the FP32 model itself with a fixed seed
(temperature 1), so perplexity on it is meaningful for this model.

    python scripts/make_builtin.py [--out evalharness/builtin/tiny-llama]
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512, "hidden_size": 128,
    "intermediate_size": 384, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 32, "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
    "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
}


def heavy(g: torch.Generator, *shape: int, df: float = 4.0) -> torch.Tensor:
    """Student-t(df) samples scaled to unit variance (heavy tails like trained weights)."""
    z = torch.randn(*shape, generator=g)
    chi2 = torch.randn(int(df), *shape, generator=g).pow(2).sum(0)
    return z / torch.sqrt(chi2 / df) * math.sqrt((df - 2) / df)


def build_weights(seed: int = 1234) -> dict[str, torch.Tensor]:
    """The seeded weights (HF Llama names)."""
    g = torch.Generator().manual_seed(seed)
    c = CONFIG
    d, f, L, v = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    hd, h, kv = c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"]
    w: dict[str, torch.Tensor] = {}
    emb = heavy(g, v, d) * 0.6
    outliers = torch.tensor([7, 77])  # "massive activation" channels of the residual stream
    emb[:, outliers] *= 12.0
    w["model.embed_tokens.weight"] = emb
    for i in range(L):
        p = f"model.layers.{i}."
        gain = 0.8 + 0.4 * torch.rand(d, generator=g)
        gain[outliers] = 0.05  # trained models learn to damp the massive channels in the norm
        gain[torch.randint(0, d, (3,), generator=g)] *= 6.0  # outlier input channels to the GEMMs
        w[p + "input_layernorm.weight"] = gain
        w[p + "post_attention_layernorm.weight"] = gain.flip(0).clone()
        w[p + "self_attn.q_proj.weight"] = heavy(g, h * hd, d) / math.sqrt(d) * 0.8
        w[p + "self_attn.k_proj.weight"] = heavy(g, kv * hd, d) / math.sqrt(d) * 0.8
        w[p + "self_attn.v_proj.weight"] = heavy(g, kv * hd, d) / math.sqrt(d)
        w[p + "self_attn.o_proj.weight"] = heavy(g, d, h * hd) / math.sqrt(h * hd) * 0.7
        w[p + "mlp.gate_proj.weight"] = heavy(g, f, d) / math.sqrt(d) * 0.8
        w[p + "mlp.up_proj.weight"] = heavy(g, f, d) / math.sqrt(d)
        w[p + "mlp.down_proj.weight"] = heavy(g, d, f) / math.sqrt(f) * 0.7
    w["model.norm.weight"] = 0.8 + 0.4 * torch.rand(d, generator=g)
    w["model.norm.weight"][outliers] = 0.05
    w["lm_head.weight"] = heavy(g, v, d) / math.sqrt(d) * 7.0  # peaked next-token distributions
    return {k: t.contiguous().float() for k, t in w.items()}


@torch.no_grad()
def sample_corpus(model_dir: Path, n_seq: int = 8, length: int = 512, seed: int = 0) -> list[int]:
    """Tokens sampled (temperature 1, no top-k/top-p) from the FP32 model with transformers, seeded, BOS-started.

    Sequences are concatenated without their BOS; evals re-insert BOS (the config's bos_token_id)
    at the start of every window.
    """
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    torch.manual_seed(seed)
    bos = torch.full((n_seq, 1), CONFIG["bos_token_id"])
    out = model.generate(bos, attention_mask=torch.ones_like(bos), do_sample=True, top_k=0, top_p=1.0,
                         temperature=1.0, max_new_tokens=length - 1, min_new_tokens=length - 1,
                         pad_token_id=CONFIG["eos_token_id"])
    return out[:, 1:].reshape(-1).tolist()


def main() -> None:
    """Write config.json, model.safetensors and corpus.json."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "evalharness/builtin/tiny-llama"))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(CONFIG, indent=2) + "\n")
    save_file(build_weights(), str(out / "model.safetensors"), metadata={"format": "pt"})
    tokens = sample_corpus(out)
    (out / "corpus.json").write_text(json.dumps({
        "description": "sampled from the FP32 tiny-llama (transformers generate, seed 0, temperature 1), 8 x 511 tokens after BOS",
        "vocab_size": CONFIG["vocab_size"], "tokens": tokens}) + "\n")
    print(f"wrote {out}: {sum(p.stat().st_size for p in out.iterdir()) / 1e6:.2f} MB, {len(tokens)} corpus tokens")


if __name__ == "__main__":
    main()
