"""How much the gate-selftest bugs that the smoke gate misses can matter: a stress model built to expose them.

    python benchmarks/selftest_stress.py

A random 2-layer Llama (transformers config classes, hidden 128, an 8192-wide
MLP so down_proj has K = 8192, one KV head's keys scaled x20 in every layer),
1024-token windows. Prints KL(fp32 || recipe) for fp8-block and its planted
variants softmax-bf16 and tc14-without-promotion, and for fp8-kv and its
per-tensor-K-scale variant (suites/selftest/). CPU, about a minute.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def main() -> None:
    """Build the stress model, score the recipes, print the table."""
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    import safetensors.torch as st

    from engine.api import Engine
    from engine.loading import load_model
    from engine.model import Transformer
    from benchmarks.common import fingerprint
    from evalharness.evals.tokenstats import kl_from_logprobs
    from tests.conftest import write_random_llama

    print("machine:", json.dumps(fingerprint("cpu")))
    with tempfile.TemporaryDirectory() as tmp:
        d = write_random_llama(Path(tmp) / "stress", seed=3, vocab_size=512, hidden_size=128,
                               intermediate_size=8192, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, max_position_embeddings=2048)
        w = st.load_file(str(d / "model.safetensors"))
        for i in range(2):  # KV head 0 (rows 0..31 of k_proj) becomes a x20 outlier head
            w[f"model.layers.{i}.self_attn.k_proj.weight"][:32] *= 20
        st.save_file(w, str(d / "model.safetensors"))
        loaded = load_model(str(d))
    model = Transformer(loaded.cfg, loaded.weights)
    x = torch.randint(0, 512, (2, 1024), generator=torch.Generator().manual_seed(0))
    ref = torch.log_softmax(Engine(model, "fp32").logits(x).double(), -1)
    sel = REPO / "suites" / "selftest"
    print(f"{'recipe':48s} {'KL(fp32 || recipe)':>18s} {'s':>6s}")
    for name in ("fp8-block", sel / "softmax-bf16.yaml", sel / "accum-tc14-no-promotion.yaml", "fp8-kv",
                 sel / "kv-k-per-tensor.yaml"):
        t0 = time.time()
        lq = torch.log_softmax(Engine(model, str(name)).logits(x).double(), -1)
        kld = float(kl_from_logprobs(ref, lq).mean())
        print(f"{Path(str(name)).stem:48s} {kld:18.5f} {time.time() - t0:6.1f}")


if __name__ == "__main__":
    main()
