#!/usr/bin/env python3
"""Train the model zoo: two small, real language models for the FP8 correctness harness.

The script

1. trains a byte-level BPE tokenizer (vocab 4096) on the training text,
2. trains ``zoo-llama`` (a dense ``LlamaForCausalLM`` with GQA) and ``zoo-moe``
   (a ``DeepseekV3ForCausalLM``: MLA attention, a shared expert plus routed experts
   with sigmoid, group-limited top-k routing and aux-loss-free load balancing
   through ``e_score_correction_bias``),
3. evaluates each one (validation loss, token-level perplexity on two held-out test
   files, a greedy sample),
4. saves each one as a plain Hugging Face directory (fp32 safetensors, config,
   tokenizer files, generation config, model card, training log), and
5. re-loads every saved directory with plain ``transformers`` in fp32 and recomputes
   the held-out perplexity, to confirm the numbers on the model card.

Data (public domain / MIT only; the test files are used for evaluation only):

* training: ``text/tinyshakespeare/input.txt`` (public domain),
  ``text/simplebooks92/valid.txt`` (public-domain books), ``tasks/gsm8k/train.jsonl``
  (MIT). The last 2% of the lines of each file are held out as the validation set.
* evaluation only: ``text/simplebooks92/test.txt`` and ``text/wikitext2/wiki.test.raw``.

Typical use::

    # CPU smoke test (a minute or two)
    python scripts/train_zoo.py --device cpu --steps 5 --tiny --out-dir /tmp/zoo_smoke
    # the real run on one GPU (about 3.5 minutes of training per model at most)
    python scripts/train_zoo.py --device cuda --max-minutes 3.5 --out-dir zoo
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import random
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]

# Special tokens: ids are fixed by the order in which they are given to the BPE trainer.
BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, UNK_TOKEN = "<s>", "</s>", "<pad>", "<unk>"
SPECIAL_TOKENS = [BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, UNK_TOKEN]
BOS_ID, EOS_ID, PAD_ID, UNK_ID = 0, 1, 2, 3

TRAIN_FILES = {
    "tinyshakespeare": "text/tinyshakespeare/input.txt",
    "simplebooks92-valid": "text/simplebooks92/valid.txt",
    "gsm8k-train": "tasks/gsm8k/train.jsonl",
}
TEST_FILES = {
    "simplebooks92-test": "text/simplebooks92/test.txt",
    "wikitext2-test": "text/wikitext2/wiki.test.raw",
}
LICENCES = {
    "tinyshakespeare": "public domain (Shakespeare; karpathy/char-rnn tinyshakespeare)",
    "simplebooks92-valid": "public-domain books (Project Gutenberg, SimpleBooks-92)",
    "gsm8k-train": "MIT (openai/grade-school-math)",
    "simplebooks92-test": "public-domain books (Project Gutenberg, SimpleBooks-92)",
    "wikitext2-test": "CC BY-SA 3.0 (WikiText-2, evaluation only)",
}
SAMPLE_PROMPTS = ["Once upon a time", "ROMEO:", "Question: Tom has 3 apples"]
VAL_FRACTION = 0.02


# --------------------------------------------------------------------------- utilities


def log(msg: str) -> None:
    """Print one timestamped line to stdout and flush it."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def set_seed(seed: int) -> None:
    """Seed Python, and torch (CPU and CUDA) random number generators."""
    random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


def hardware_fingerprint(device: torch.device) -> dict:
    """Collect versions and hardware facts (GPU name, driver, torch, CUDA, transformers)."""
    import tokenizers
    import transformers

    info = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "device": str(device),
        "cpu_count": os.cpu_count(),
    }
    try:
        import safetensors

        info["safetensors"] = safetensors.__version__
    except Exception:  # pragma: no cover - informational only
        pass
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info["gpu_name"] = props.name
        info["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        info["gpu_capability"] = f"{props.major}.{props.minor}"
        info["cudnn"] = torch.backends.cudnn.version()
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=30,
            )
            info["nvidia_smi"] = out.stdout.strip()
            if out.stdout.strip():
                info["driver"] = out.stdout.strip().splitlines()[0].split(",")[-1].strip()
        except Exception as exc:  # pragma: no cover - informational only
            info["nvidia_smi"] = f"unavailable ({exc})"
    return info


def default_data_dir() -> Path:
    """Return the data directory: $EVALHARNESS_DATA_DIR, else ../shared/data beside the repo."""
    env = os.environ.get("EVALHARNESS_DATA_DIR")
    if env:
        return Path(env)
    return (REPO_ROOT / ".." / "shared" / "data").resolve()


# --------------------------------------------------------------------------- data


@dataclass
class Corpus:
    """Training/validation documents per source, and the raw test texts."""

    train_docs: dict[str, list[str]] = field(default_factory=dict)
    val_docs: dict[str, list[str]] = field(default_factory=dict)
    test_texts: dict[str, str] = field(default_factory=dict)


def split_lines(lines: list[str]) -> tuple[list[str], list[str]]:
    """Split a list of lines into the first 98% (train) and the last 2% (validation)."""
    n_val = max(1, int(round(len(lines) * VAL_FRACTION)))
    return lines[:-n_val], lines[-n_val:]


def gsm8k_doc(line: str) -> str:
    """Turn one GSM8K jsonl line into one training document (question, newline, answer)."""
    rec = json.loads(line)
    return rec["question"].strip() + "\n" + rec["answer"].strip()


def load_corpus(data_dir: Path, tiny: bool) -> Corpus:
    """Read the training files (holding out the last 2% of each) and the test files.

    Plain-text files become one document each for their train and their validation part;
    every GSM8K record is its own document. With ``tiny`` only a small prefix of each file
    is kept, for a fast smoke test.
    """
    corpus = Corpus()
    for name, rel in {**TRAIN_FILES, **TEST_FILES}.items():
        path = data_dir / rel
        if not path.is_file():
            raise SystemExit(f"missing data file {path} (set --data-dir or EVALHARNESS_DATA_DIR)")
    for name, rel in TRAIN_FILES.items():
        text = (data_dir / rel).read_text(encoding="utf-8")
        lines = text.splitlines(keepends=True)
        if tiny:
            lines = lines[: 2000 if not rel.endswith(".jsonl") else 300]
        train_lines, val_lines = split_lines(lines)
        if rel.endswith(".jsonl"):
            corpus.train_docs[name] = [gsm8k_doc(x) for x in train_lines if x.strip()]
            corpus.val_docs[name] = [gsm8k_doc(x) for x in val_lines if x.strip()]
        else:
            corpus.train_docs[name] = ["".join(train_lines)]
            corpus.val_docs[name] = ["".join(val_lines)]
    for name, rel in TEST_FILES.items():
        text = (data_dir / rel).read_text(encoding="utf-8")
        corpus.test_texts[name] = text[:60000] if tiny else text
    return corpus


def train_tokenizer(corpus: Corpus, vocab_size: int, tiny: bool):
    """Train a byte-level BPE tokenizer on the training documents only.

    Returns a ``transformers.PreTrainedTokenizerFast`` with ``<s>``=0 (BOS), ``</s>``=1
    (EOS), ``<pad>``=2 (PAD) and ``<unk>``=3 (UNK; never produced, since byte-level BPE
    covers every byte). Its post-processor prepends BOS when ``add_special_tokens=True``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )

    def iterate():
        """Yield the training documents in chunks of about 8 KB."""
        for docs in corpus.train_docs.values():
            for doc in docs:
                for i in range(0, len(doc), 8192):
                    yield doc[i: i + 8192]

    tok.train_from_iterator(iterate(), trainer=trainer)
    if not tiny:
        assert tok.get_vocab_size() == vocab_size, tok.get_vocab_size()
    for tid, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == tid, (t, tok.token_to_id(t))
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, BOS_ID)],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        model_max_length=1024,
        clean_up_tokenization_spaces=False,
    )


def encode(tokenizer, text: str) -> list[int]:
    """Encode text to ids without special tokens (through the fast backend: no length warning)."""
    return tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids


def build_stream(tokenizer, docs: dict[str, list[str]]) -> torch.Tensor:
    """Concatenate the documents of all sources as ``<s> doc </s>`` into one int64 stream."""
    ids: list[int] = []
    for name in docs:
        texts = docs[name]
        batch = tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False)
        for enc in batch:
            seq = enc.ids
            ids.append(BOS_ID)
            ids.extend(seq)
            ids.append(EOS_ID)
    return torch.tensor(ids, dtype=torch.long)


# --------------------------------------------------------------------------- models


def llama_config(vocab_size: int, tiny: bool):
    """Return the ``LlamaConfig`` of zoo-llama (or of a tiny stand-in for the smoke test)."""
    from transformers import LlamaConfig

    dims = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=6,
                num_attention_heads=8, num_key_value_heads=4)
    if tiny:
        dims = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2)
    return LlamaConfig(
        vocab_size=vocab_size,
        **dims,
        hidden_act="silu",
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        initializer_range=0.02,
        use_cache=True,
    )


def moe_config(vocab_size: int, tiny: bool):
    """Return the ``DeepseekV3Config`` of zoo-moe (or of a tiny stand-in for the smoke test).

    Routing: sigmoid scores (hard-wired in transformers' ``DeepseekV3TopkRouter``; the
    ``scoring_func``/``topk_method`` keys are stored for other loaders and are ignored by
    transformers), ``e_score_correction_bias`` added for the choice only, ``n_group`` groups
    scored by the sum of their top-2 biased scores, the best ``topk_group`` groups kept,
    ``num_experts_per_tok`` experts chosen among them, weights = unbiased sigmoid scores
    normalised to sum 1 (``norm_topk_prob``) times ``routed_scaling_factor``.
    """
    from transformers import DeepseekV3Config

    dims = dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                num_hidden_layers=5, num_attention_heads=8, q_lora_rank=128, kv_lora_rank=64,
                qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32)
    if tiny:
        dims = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                    num_hidden_layers=3, num_attention_heads=4, q_lora_rank=32, kv_lora_rank=16,
                    qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
    return DeepseekV3Config(
        vocab_size=vocab_size,
        **dims,
        num_key_value_heads=dims["num_attention_heads"],
        n_shared_experts=1,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        scoring_func="sigmoid",
        topk_method="noaux_tc",
        num_nextn_predict_layers=0,
        hidden_act="silu",
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rope_interleave=True,
        attention_bias=False,
        tie_word_embeddings=True,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        initializer_range=0.02,
        use_cache=True,
    )


def count_params(model: torch.nn.Module) -> int:
    """Count unique parameters (tied weights once)."""
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total


class BiasBalancer:
    """Aux-loss-free load balancing of DeepSeek-V3 (Wang et al. 2024; DeepSeek-V3 report §2.1.2).

    A forward hook on every ``DeepseekV3TopkRouter`` (``model.layers[i].mlp.gate``) counts,
    in training mode only, how many tokens each routed expert received (its third output
    is ``topk_indices``). After each optimiser step, ``update()`` moves each layer's
    ``e_score_correction_bias`` buffer by ``gamma * sign(mean_load - load_i)``: overloaded
    experts get a lower bias, underloaded ones a higher, so the choice evens out while the
    gating weights (which use the unbiased scores) are untouched.
    """

    def __init__(self, model: torch.nn.Module, gamma: float):
        """Find the router modules of ``model`` and register the counting hooks."""
        self.gamma = gamma
        self.gates = []
        self.counts = []
        self.handles = []
        for name, mod in model.named_modules():
            if type(mod).__name__ == "DeepseekV3TopkRouter":
                idx = len(self.gates)
                self.gates.append((name, mod))
                self.counts.append(None)
                self.handles.append(mod.register_forward_hook(self._make_hook(idx)))
        self.last_loads: list[torch.Tensor] = []

    def _make_hook(self, idx: int):
        """Return a forward hook that accumulates the expert counts of router ``idx``."""

        def hook(module, inputs, outputs):
            """Accumulate the per-expert token counts of one router call (training only)."""
            if not module.training:
                return
            topk_idx = outputs[2].detach().reshape(-1)
            c = torch.bincount(topk_idx, minlength=module.num_experts).float()
            self.counts[idx] = c if self.counts[idx] is None else self.counts[idx] + c

        return hook

    @torch.no_grad()
    def update(self) -> None:
        """Apply the sign update to every router's bias and reset the counts."""
        self.last_loads = []
        for i, (_, gate) in enumerate(self.gates):
            load = self.counts[i]
            if load is None:
                continue
            err = load.mean() - load
            gate.e_score_correction_bias.add_(self.gamma * torch.sign(err).to(gate.e_score_correction_bias.dtype))
            self.last_loads.append(load)
            self.counts[i] = None

    def imbalance(self) -> list[float]:
        """Return max_load / mean_load per layer for the last update (1.0 = perfectly balanced)."""
        return [float(l.max() / l.mean().clamp_min(1e-9)) for l in self.last_loads]

    def biases(self) -> dict[str, list[float]]:
        """Return the current bias vector of every router, keyed by module name."""
        return {n: [round(float(x), 4) for x in g.e_score_correction_bias] for n, g in self.gates}

    def remove(self) -> None:
        """Remove the hooks."""
        for h in self.handles:
            h.remove()


@torch.no_grad()
def routing_stats(model: torch.nn.Module, stream: torch.Tensor, seq_len: int, device: torch.device,
                  max_windows: int = 32) -> dict:
    """Measure per-layer expert load (max/mean) of the model, in eval mode, on ``stream``."""
    gates = [(n, m) for n, m in model.named_modules() if type(m).__name__ == "DeepseekV3TopkRouter"]
    if not gates:
        return {}
    counts = {n: torch.zeros(m.num_experts, device=device) for n, m in gates}
    handles = []
    for n, m in gates:
        def hook(module, inputs, outputs, n=n):
            """Accumulate expert counts in evaluation mode."""
            counts[n] += torch.bincount(outputs[2].reshape(-1), minlength=module.num_experts).float()
        handles.append(m.register_forward_hook(hook))
    model.eval()
    n = min(max_windows, (stream.numel() - 1) // seq_len)
    for i in range(n):
        x = stream[i * seq_len:(i + 1) * seq_len].unsqueeze(0).to(device)
        model(input_ids=x)
    for h in handles:
        h.remove()
    return {n: {"max_over_mean": round(float(c.max() / c.mean()), 3),
                "load_fraction": [round(float(v), 4) for v in (c / c.sum())]} for n, c in counts.items()}


# --------------------------------------------------------------------------- evaluation


@torch.no_grad()
def window_nll(model, stream: torch.Tensor, seq_len: int, device: torch.device, batch_size: int,
               autocast_dtype=None, max_windows: int | None = None) -> tuple[float, int]:
    """Sum of next-token NLL over non-overlapping windows of ``seq_len`` tokens.

    The stream is cut into ``floor(N / seq_len)`` windows; within each, tokens 2..seq_len
    are predicted from their prefix (the first token of a window has no context and is
    not scored). Returns (total NLL in nats, number of predicted tokens).
    """
    model.eval()
    n_win = stream.numel() // seq_len
    if max_windows is not None:
        n_win = min(n_win, max_windows)
    if n_win == 0:
        raise ValueError("stream shorter than one window")
    windows = stream[: n_win * seq_len].view(n_win, seq_len)
    total, count = 0.0, 0
    for i in range(0, n_win, batch_size):
        x = windows[i: i + batch_size].to(device)
        if autocast_dtype is not None:
            with torch.autocast(device_type=device.type, dtype=autocast_dtype):
                logits = model(input_ids=x).logits
        else:
            logits = model(input_ids=x).logits
        logits = logits[:, :-1].float()
        tgt = x[:, 1:]
        nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), tgt.reshape(-1),
                                                reduction="sum")
        total += float(nll)
        count += tgt.numel()
    return total, count


def heldout_eval(model, tokenizer, texts: dict[str, str], seq_len: int, device: torch.device,
                 batch_size: int, max_windows: int | None) -> dict:
    """Token-level perplexity (and bits per byte) of ``model`` on each raw test text, in fp32."""
    res = {}
    for name, text in texts.items():
        ids = torch.tensor(encode(tokenizer, text), dtype=torch.long)
        nll, n = window_nll(model, ids, seq_len, device, batch_size, None, max_windows)
        n_win = n // (seq_len - 1)
        # bytes covered by the scored tokens (approximately: proportional share of the text)
        covered_tokens = n_win * seq_len
        n_bytes = len(text.encode("utf-8")) * covered_tokens / max(1, ids.numel())
        res[name] = {
            "ppl": math.exp(nll / n),
            "nll_per_token": nll / n,
            "bits_per_byte": nll / math.log(2) / n_bytes,
            "scored_tokens": n,
            "windows": n_win,
            "total_tokens": ids.numel(),
        }
    return res


@torch.no_grad()
def greedy_samples(model, tokenizer, device: torch.device, max_new_tokens: int) -> dict[str, str]:
    """Greedy continuations (BOS + prompt) of the fixed sample prompts."""
    model.eval()
    out = {}
    for prompt in SAMPLE_PROMPTS:
        enc = tokenizer(prompt, return_tensors="pt").to(device)
        gen = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=PAD_ID, eos_token_id=EOS_ID)
        out[prompt] = tokenizer.decode(gen[0], skip_special_tokens=True)
    return out


# --------------------------------------------------------------------------- training


def epochs_for(spec: str | None, kind: str) -> float | None:
    """Parse ``--max-epochs``: a number for every model, or ``name=N,name=N`` per model."""
    if spec is None or str(spec).strip() == "":
        return None
    spec = str(spec)
    if "=" not in spec:
        return float(spec)
    for part in spec.split(","):
        name, _, val = part.partition("=")
        if name.strip() == kind:
            return float(val)
    return None


def lr_at(step: int, total: int | None, warmup: int, peak: float, min_ratio: float) -> float:
    """Linear warm-up to ``peak``, then cosine decay to ``min_ratio * peak`` at ``total``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    if total is None:
        return peak
    prog = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * prog)))


def pick_experts_impl(model, device: torch.device, args, train_stream: torch.Tensor) -> str:
    """On CUDA, time a few fwd+bwd steps with each transformers experts implementation and keep the fastest."""
    if device.type != "cuda":
        return model.config._experts_implementation
    x = train_stream[: args.batch_size * args.seq_len].view(args.batch_size, args.seq_len).to(device)
    best, best_t = None, float("inf")
    state = copy.deepcopy(model.state_dict())
    for impl in ("grouped_mm", "eager"):
        try:
            model.set_experts_implementation(impl)
            times = []
            for _ in range(4):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model(input_ids=x, labels=x).loss
                loss.backward()
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            model.zero_grad(set_to_none=True)
            t = min(times[1:])
            log(f"experts implementation {impl}: {t * 1e3:.1f} ms per fwd+bwd step")
            if t < best_t:
                best, best_t = impl, t
        except Exception as exc:  # pragma: no cover - depends on the GPU stack
            log(f"experts implementation {impl} failed: {type(exc).__name__}: {exc}")
            model.zero_grad(set_to_none=True)
    model.load_state_dict(state)
    model.set_experts_implementation(best)
    return best


def train_model(kind: str, config, tokenizer, train_stream, val_stream, device, args) -> dict:
    """Train one model; return the model (best validation weights restored) and its record."""
    from transformers import AutoModelForCausalLM

    set_seed(args.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(device)
    n_params = count_params(model)
    log(f"{kind}: {n_params:,} parameters ({n_params * 4 / 1e6:.2f} MB fp32)")
    experts_impl = None
    if kind == "zoo-moe":
        experts_impl = pick_experts_impl(model, device, args, train_stream)
        log(f"{kind}: training with experts implementation {experts_impl}")
    balancer = BiasBalancer(model, args.bias_gamma) if kind == "zoo-moe" else None

    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (decay if p.dim() >= 2 and "embed" not in n else no_decay).append(p)
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda",
    )
    use_amp = device.type == "cuda"
    gen = torch.Generator().manual_seed(args.seed)
    n_train = train_stream.numel()
    tokens_per_step = args.batch_size * args.seq_len
    epoch_steps = max(1, n_train // tokens_per_step)
    step_cap = args.steps
    max_epochs = epochs_for(args.max_epochs, kind)
    if max_epochs and args.steps is None:
        step_cap = int(max_epochs * epoch_steps)
    total = step_cap if args.steps is not None else None  # fixed after calibration otherwise
    warmup = min(args.warmup, max(1, (step_cap or args.warmup * 10) // 10))
    budget_s = args.max_minutes * 60.0
    log(f"{kind}: {n_train:,} training tokens, {tokens_per_step:,} tokens/step, "
        f"{epoch_steps} steps/epoch, step cap {step_cap}, warmup {warmup}, budget {budget_s:.0f}s")

    record = {"loss_curve": [], "val_curve": [], "lr_curve": [], "imbalance_curve": []}
    best_val, best_state, best_step = float("inf"), None, -1
    t_start = time.perf_counter()
    train_time = 0.0
    step = 0
    calib_at = 25
    t_calib0 = None
    while True:
        if total is not None and step >= total:
            break
        if step_cap is not None and step >= step_cap:
            break
        if train_time > budget_s * 1.05:
            log(f"{kind}: time budget exhausted at step {step}")
            break
        t0 = time.perf_counter()
        model.train()
        starts = torch.randint(0, n_train - args.seq_len - 1, (args.batch_size,), generator=gen)
        batch = torch.stack([train_stream[s: s + args.seq_len + 1] for s in starts.tolist()])
        batch = batch.to(device, non_blocking=True)
        x, y = batch[:, :-1], batch[:, 1:]
        lr = lr_at(step, total, warmup, args.lr, args.min_lr_ratio)
        for g in opt.param_groups:
            g["lr"] = lr
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=use_amp):
            logits = model(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        if balancer is not None:
            balancer.update()
        step += 1
        if device.type == "cuda" and step % args.log_every == 0:
            torch.cuda.synchronize()
        train_time += time.perf_counter() - t0

        # calibrate the step count to the time budget (only when --steps is not given)
        if total is None and args.steps is None:
            if step == 5:
                t_calib0 = train_time
            if step == calib_at:
                per_step = (train_time - t_calib0) / (calib_at - 5)
                eval_overhead = 1.08  # evaluation and logging, measured roughly
                fit = int(budget_s / (per_step * eval_overhead))
                total = min(fit, step_cap) if step_cap else fit
                total = max(total, calib_at + 1)
                log(f"{kind}: calibrated {per_step * 1e3:.1f} ms/step -> {total} steps "
                    f"({total * tokens_per_step / n_train:.1f} epochs)")

        if step % args.log_every == 0 or step == 1:
            cur = float(loss.detach())
            elapsed = time.perf_counter() - t_start
            record["loss_curve"].append([step, round(cur, 4)])
            record["lr_curve"].append([step, float(f"{lr:.3e}")])
            msg = (f"{kind} step {step}/{total or '?'} loss {cur:.4f} lr {lr:.2e} "
                   f"tok/s {step * tokens_per_step / max(train_time, 1e-9):,.0f} t {elapsed:.0f}s")
            if balancer is not None and balancer.last_loads:
                imb = balancer.imbalance()
                record["imbalance_curve"].append([step, [round(v, 3) for v in imb]])
                msg += " load max/mean " + ",".join(f"{v:.2f}" for v in imb)
            log(msg)
        if step % args.eval_every == 0 or (total is not None and step == total):
            vn, vc = window_nll(model, val_stream, args.seq_len, device, args.eval_batch_size,
                                torch.bfloat16 if use_amp else None)
            vloss = vn / vc
            record["val_curve"].append([step, round(vloss, 4)])
            tag = ""
            if vloss < best_val:
                best_val, best_step = vloss, step
                best_state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
                tag = " (best)"
            log(f"{kind} step {step} val_loss {vloss:.4f} val_ppl {math.exp(vloss):.2f}{tag}")
    wall = time.perf_counter() - t_start
    # final train loss: mean over a few fresh batches at the final weights (train mode)
    final_train = train_loss_estimate(model, train_stream, args, device, gen)
    if best_state is None or step not in [s for s, _ in record["val_curve"]]:
        vn, vc = window_nll(model, val_stream, args.seq_len, device, args.eval_batch_size,
                            torch.bfloat16 if use_amp else None)
        record["val_curve"].append([step, round(vn / vc, 4)])
        if vn / vc < best_val:
            best_val, best_step = vn / vc, step
            best_state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    if best_state is not None and best_step != step:
        log(f"{kind}: restoring best validation weights from step {best_step}")
        model.load_state_dict(best_state)
    saved_train = train_loss_estimate(model, train_stream, args, device,
                                      torch.Generator().manual_seed(args.seed + 1))
    if balancer is not None:
        balancer.remove()
    record.update(
        steps=step,
        best_step=best_step,
        tokens_seen=step * tokens_per_step,
        tokens_seen_at_best=best_step * tokens_per_step,
        epochs=step * tokens_per_step / n_train,
        train_tokens=n_train,
        wall_time_s=round(wall, 1),
        train_time_s=round(train_time, 1),
        final_train_loss_at_last_step=round(final_train, 4),
        train_loss_of_saved_weights=round(saved_train, 4),
        n_params=n_params,
        experts_implementation=experts_impl,
        warmup=warmup,
        total_steps_planned=total,
    )
    return {"model": model, "record": record}


@torch.no_grad()
def train_loss_estimate(model, train_stream, args, device, gen, n_batches: int = 4) -> float:
    """Mean training loss of the current weights on a few random training batches (eval mode)."""
    model.eval()
    n_train = train_stream.numel()
    tot = 0.0
    for _ in range(n_batches):
        starts = torch.randint(0, n_train - args.seq_len - 1, (args.batch_size,), generator=gen)
        batch = torch.stack([train_stream[s: s + args.seq_len + 1] for s in starts.tolist()]).to(device)
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(input_ids=batch[:, :-1]).logits
        tot += float(torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.size(-1)),
                                                       batch[:, 1:].reshape(-1)))
    return tot / n_batches


# --------------------------------------------------------------------------- saving


def dir_size_mb(path: Path, pattern: str = "*.safetensors") -> float:
    """Total size in MB (1e6 bytes) of the files of ``path`` matching ``pattern``."""
    return sum(p.stat().st_size for p in path.glob(pattern)) / 1e6


def arch_lines(kind: str, cfg) -> list[str]:
    """Markdown bullet lines describing the architecture of one zoo model."""
    c = cfg.to_dict()
    if kind == "zoo-llama":
        return [
            "- `LlamaForCausalLM` (dense, pre-norm RMSNorm, SwiGLU MLP, RoPE (rotate-half), GQA)",
            f"- hidden {c['hidden_size']}, layers {c['num_hidden_layers']}, heads {c['num_attention_heads']} "
            f"(head_dim {c['hidden_size'] // c['num_attention_heads']}), KV heads {c['num_key_value_heads']}, "
            f"intermediate {c['intermediate_size']}",
            f"- rope_theta {c['rope_parameters']['rope_theta']}, max_position_embeddings "
            f"{c['max_position_embeddings']}, rms_norm_eps {c['rms_norm_eps']}",
            f"- tied input/output embeddings: {c['tie_word_embeddings']}, vocab {c['vocab_size']}",
        ]
    return [
        "- `DeepseekV3ForCausalLM` (DeepSeek-V3 architecture: MLA attention, DeepSeekMoE with a shared expert)",
        f"- hidden {c['hidden_size']}, layers {c['num_hidden_layers']} (first_k_dense_replace "
        f"{c['first_k_dense_replace']}: layer 0 has a dense SwiGLU MLP of intermediate {c['intermediate_size']}, "
        f"layers 1.. are MoE)",
        f"- MLA: heads {c['num_attention_heads']}, q_lora_rank {c['q_lora_rank']}, kv_lora_rank "
        f"{c['kv_lora_rank']}, qk_nope_head_dim {c['qk_nope_head_dim']}, qk_rope_head_dim "
        f"{c['qk_rope_head_dim']}, v_head_dim {c['v_head_dim']}, rope_interleave {c['rope_interleave']}",
        f"- MoE: n_routed_experts {c['n_routed_experts']}, n_shared_experts {c['n_shared_experts']}, "
        f"moe_intermediate_size {c['moe_intermediate_size']}, num_experts_per_tok {c['num_experts_per_tok']}",
        f"- router: sigmoid scores + `e_score_correction_bias` (choice only), group-limited: n_group "
        f"{c['n_group']}, topk_group {c['topk_group']} (group score = sum of its top-2 biased scores), "
        f"norm_topk_prob {c['norm_topk_prob']}, routed_scaling_factor {c['routed_scaling_factor']}",
        "- aux-loss-free load balancing during training: after every step each layer's bias moved by "
        "±gamma·sign(mean_load − load_i)",
        f"- rope_theta {c['rope_parameters']['rope_theta']}, max_position_embeddings "
        f"{c['max_position_embeddings']}, tied embeddings {c['tie_word_embeddings']}, vocab {c['vocab_size']}",
    ]


def write_card(out: Path, kind: str, cfg, rec: dict, evals: dict, samples: dict, fp: dict,
               args, size_mb: float, routing: dict | None, command: str) -> None:
    """Write the README.md model card of one zoo model."""
    gpu = fp.get("gpu_name", "CPU") + (f" (driver {fp['driver']})" if fp.get("driver") else "")
    lines = [
        "---",
        "license: mit",
        "library_name: transformers",
        "tags: [tiny, test-model, fp8-harness]",
        "---",
        f"# {kind}",
        "",
        "A deliberately small but really trained language model, made for the FP8 numerical-correctness "
        "harness of this project (engine vs Hugging Face transformers FP32). It is not meant to be useful "
        "for anything else.",
        "",
        "## Architecture",
        *arch_lines(kind, cfg),
        f"- parameters: {rec['n_params']:,}; weights stored as fp32 safetensors ({size_mb:.2f} MB)",
        "",
        "Full configuration: `config.json`.",
        "",
        "## Tokenizer",
        f"Byte-level BPE trained by `scripts/train_zoo.py` with the `tokenizers` library on the training "
        f"split below (vocab {cfg.vocab_size}). Special tokens: `<s>`=0 (BOS), `</s>`=1 (EOS), `<pad>`=2 "
        "(PAD), `<unk>`=3 (UNK; never produced). `tokenizer(text)` prepends BOS; the decoder is byte-level. "
        "Shared by zoo-llama and zoo-moe.",
        "",
        "## Data",
        "| file | role | licence |",
        "|---|---|---|",
    ]
    for name, rel in TRAIN_FILES.items():
        lines.append(f"| `{rel}` | training (first 98% of lines) + validation (last 2%) | {LICENCES[name]} |")
    for name, rel in TEST_FILES.items():
        lines.append(f"| `{rel}` | held-out evaluation only | {LICENCES[name]} |")
    lines += [
        "",
        "Training documents are `<s> text </s>`: one per plain-text file part and one per GSM8K record "
        "(question, newline, answer). Training windows are random slices of the concatenated stream.",
        "",
        "## Training",
        f"- seed {args.seed}; AdamW (betas 0.9/0.95, weight decay {args.weight_decay}), peak lr {args.lr}, "
        f"linear warm-up {rec['warmup']} steps then cosine to {args.min_lr_ratio}×peak, grad clip {args.grad_clip}",
        f"- bf16 autocast on GPU, fp32 master weights; sequence length {args.seq_len}, batch {args.batch_size} "
        f"({args.batch_size * args.seq_len:,} tokens/step)",
        f"- steps {rec['steps']} ({rec['epochs']:.1f} epochs of {rec['train_tokens']:,} training tokens), "
        f"tokens seen {rec['tokens_seen']:,}; wall time {rec['wall_time_s']} s (pure training {rec['train_time_s']} s)",
        f"- checkpoint kept: best validation loss, at step {rec['best_step']} "
        f"({rec['tokens_seen_at_best']:,} tokens seen)",
        f"- final train loss (mean of 4 random training batches): {rec['train_loss_of_saved_weights']} for the "
        f"saved weights, {rec['final_train_loss_at_last_step']} for the last step's weights",
        f"- hardware: {gpu}; torch {fp['torch']} (CUDA {fp['torch_cuda']}), transformers {fp['transformers']}",
    ]
    if kind == "zoo-moe":
        lines.append(f"- load-balancing bias step gamma {args.bias_gamma}; experts implementation used for "
                     f"training: `{rec['experts_implementation']}`")
    lines += [
        "",
        "Command:",
        "```",
        command,
        "```",
        "",
        "## Evaluation (fp32, no autocast)",
        f"- validation loss (last 2% of the training files, non-overlapping {args.seq_len}-token windows): "
        f"{evals['val_loss']:.4f} (PPL {math.exp(evals['val_loss']):.2f})",
        "",
        f"Held-out token-level perplexity over non-overlapping {args.seq_len}-token windows of the whole "
        f"file (tokenised without special tokens; the first token of each window is not scored). "
        f"Uniform over the vocabulary would be {cfg.vocab_size}.",
        "",
        "| test file | PPL | uniform / PPL | bits/byte | scored tokens |",
        "|---|---|---|---|---|",
    ]
    for name, r in evals["heldout"].items():
        lines.append(f"| {name} | {r['ppl']:.2f} | {cfg.vocab_size / r['ppl']:.1f}× | {r['bits_per_byte']:.3f} "
                     f"| {r['scored_tokens']:,} |")
    lines += ["", "SimpleBooks-92 test is in-domain (other books than the training part). WikiText-2 is out of "
              "domain: the training mix has no encyclopedic text, and the tokenizer was fitted to the training "
              "text (more tokens per byte on WikiText), so its perplexity is much higher."]
    if "reload_heldout" in evals:
        lines += ["", "Re-loaded from this directory with plain `AutoModelForCausalLM.from_pretrained(dir, "
                  "dtype=torch.float32)` + `AutoTokenizer.from_pretrained(dir)`: " + ", ".join(
                      f"{k} PPL {v['ppl']:.4f}" for k, v in evals["reload_heldout"].items())]
    if routing:
        lines += ["", "Expert load on validation text (eval mode, max/mean per MoE layer): " + ", ".join(
            f"{n.split('.')[2]}: {v['max_over_mean']}" for n, v in routing.items())]
    lines += ["", "## Greedy samples (BOS + prompt)", ""]
    for p, s in samples.items():
        lines += ["```", s.strip(), "```"]
    lines += ["", "`training_log.json` holds the loss, validation and learning-rate curves.", ""]
    (out / "README.md").write_text("\n".join(lines), encoding="utf-8")


def save_model(out: Path, kind: str, model, tokenizer) -> float:
    """Save weights (fp32 safetensors), config, generation config and tokenizer files; return MB."""
    from transformers import GenerationConfig

    out.mkdir(parents=True, exist_ok=True)
    model = model.to(torch.float32)
    model.generation_config = GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID,
                                               pad_token_id=PAD_ID, do_sample=False)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    # Name the generic fast-tokenizer class (known to transformers 4.x and 5.x alike) and write the
    # special-tokens map that older loaders look for.
    tc_path = out / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text(encoding="utf-8"))
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"
    tc.pop("backend", None)
    tc_path.write_text(json.dumps(tc, indent=2) + "\n", encoding="utf-8")
    stm = {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN, "unk_token": UNK_TOKEN}
    (out / "special_tokens_map.json").write_text(json.dumps(stm, indent=2) + "\n", encoding="utf-8")
    return dir_size_mb(out)


# --------------------------------------------------------------------------- main


def parse_args(argv=None) -> argparse.Namespace:
    """Parse the command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--data-dir", type=Path, default=None,
                   help="data root (default: $EVALHARNESS_DATA_DIR, else ../shared/data)")
    p.add_argument("--out-dir", type=Path, default=REPO_ROOT / "zoo")
    p.add_argument("--models", default="zoo-llama,zoo-moe")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="tiny models and data (smoke test)")
    p.add_argument("--steps", type=int, default=None, help="exact number of steps (else time budget)")
    p.add_argument("--max-minutes", type=float, default=3.5, help="training time budget per model")
    p.add_argument("--max-epochs", default="zoo-llama=8,zoo-moe=10",
                   help="cap on epochs over the training tokens when --steps is not given: one number "
                        "for all models or name=N,name=N; the cosine schedule ends there")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--eval-batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.05)
    p.add_argument("--warmup", type=int, default=150)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--bias-gamma", type=float, default=1e-3,
                   help="aux-loss-free balancing: bias update step per training step")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--eval-max-windows", type=int, default=None,
                   help="limit held-out windows (default: all; --tiny: 4)")
    p.add_argument("--sample-tokens", type=int, default=40)
    p.add_argument("--min-ppl-ratio", type=float, default=4.0,
                   help="fail (exit 1) unless every held-out PPL is below uniform (vocab) / this ratio")
    args = p.parse_args(argv)
    if args.data_dir is None:
        args.data_dir = default_data_dir()
    if args.tiny:
        if args.eval_max_windows is None:
            args.eval_max_windows = 4
        args.seq_len = min(args.seq_len, 128)
        args.batch_size = min(args.batch_size, 4)
        args.log_every = min(args.log_every, 1)
        args.eval_every = min(args.eval_every, 5)
        args.sample_tokens = min(args.sample_tokens, 8)
    return args


def main(argv=None) -> int:
    """Run the whole pipeline: tokenizer, training, evaluation, saving, re-load check."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    args = parse_args(argv)
    command = "python " + " ".join(shlex.quote(a) for a in ([sys.argv[0]] + (argv if argv is not None
                                                                                else sys.argv[1:])))
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    fp = hardware_fingerprint(device)
    log("fingerprint " + json.dumps(fp))
    log(f"args {vars(args)}")

    t0 = time.perf_counter()
    corpus = load_corpus(args.data_dir, args.tiny)
    tokenizer = train_tokenizer(corpus, args.vocab_size, args.tiny)
    vocab = len(tokenizer)
    train_stream = build_stream(tokenizer, corpus.train_docs)
    val_stream = build_stream(tokenizer, corpus.val_docs)
    for name in corpus.train_docs:
        n_tr = build_stream(tokenizer, {name: corpus.train_docs[name]}).numel()
        n_va = build_stream(tokenizer, {name: corpus.val_docs[name]}).numel()
        log(f"data {name}: train {n_tr:,} tokens, val {n_va:,} tokens")
    log(f"tokenizer: vocab {vocab}, trained in {time.perf_counter() - t0:.1f}s; train stream "
        f"{train_stream.numel():,} tokens, val stream {val_stream.numel():,} tokens")
    uniform_ppl = float(vocab if not args.tiny else args.vocab_size)

    args.out_dir.mkdir(parents=True, exist_ok=True)
    summary = {"fingerprint": fp, "command": command, "models": {}}
    results = {}
    failures: list[str] = []
    for kind in [m.strip() for m in args.models.split(",") if m.strip()]:
        cfg = llama_config(vocab, args.tiny) if kind == "zoo-llama" else moe_config(vocab, args.tiny)
        if kind not in ("zoo-llama", "zoo-moe"):
            raise SystemExit(f"unknown model {kind}")
        out = train_model(kind, cfg, tokenizer, train_stream, val_stream, device, args)
        model, rec = out["model"], out["record"]

        # fp32 evaluation of the in-memory model (TF32 off: true fp32 matmuls)
        if device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
        model = model.float().eval()
        vn, vc = window_nll(model, val_stream, args.seq_len, device, args.eval_batch_size)
        evals = {"val_loss": vn / vc}
        evals["heldout"] = heldout_eval(model, tokenizer, corpus.test_texts, args.seq_len, device,
                                        args.eval_batch_size, args.eval_max_windows)
        routing = routing_stats(model, val_stream, args.seq_len, device) if kind == "zoo-moe" else None
        samples = greedy_samples(model, tokenizer, device, args.sample_tokens)
        for k, v in evals["heldout"].items():
            log(f"{kind} fp32 held-out {k}: PPL {v['ppl']:.3f} ({v['bits_per_byte']:.3f} bits/byte, "
                f"{v['scored_tokens']:,} tokens) vs uniform {uniform_ppl:.0f}")
        log(f"{kind} fp32 val loss {evals['val_loss']:.4f}")
        for p_, s in samples.items():
            log(f"{kind} sample {p_!r}: {s!r}")
        if routing:
            log(f"{kind} routing (eval, val text): " + json.dumps({k: v["max_over_mean"] for k, v in routing.items()}))

        out_dir = args.out_dir / kind
        size_mb = save_model(out_dir, kind, model, tokenizer)
        log(f"{kind}: saved to {out_dir} ({size_mb:.2f} MB safetensors)")
        if not args.tiny and size_mb > 25.0:
            raise SystemExit(f"{kind}: {size_mb:.2f} MB exceeds the 25 MB limit")
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()

        # re-load with plain transformers, fp32, and recompute the held-out PPL
        m2 = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).to(device).eval()
        t2 = AutoTokenizer.from_pretrained(out_dir)
        try:
            with torch.no_grad():
                m2(input_ids=torch.tensor([[BOS_ID, 5, 6, 7]], device=device))
        except Exception as exc:  # pragma: no cover - depends on the GPU stack
            log(f"{kind}: default experts implementation failed on re-load ({exc}); retrying with eager")
            m2 = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32,
                                                      experts_implementation="eager").to(device).eval()
        assert t2.bos_token_id == BOS_ID and t2.eos_token_id == EOS_ID and t2.pad_token_id == PAD_ID
        for text in corpus.test_texts.values():  # the plain AutoTokenizer path gives the same ids
            assert t2(text[:5000], add_special_tokens=False)["input_ids"] == encode(tokenizer, text[:5000])
        assert t2("Hello")["input_ids"][0] == BOS_ID
        evals["reload_heldout"] = heldout_eval(m2, t2, corpus.test_texts, args.seq_len, device,
                                               args.eval_batch_size, args.eval_max_windows)
        for k in evals["heldout"]:
            a, b = evals["heldout"][k]["ppl"], evals["reload_heldout"][k]["ppl"]
            ok = abs(a - b) / a < 1e-3
            log(f"{kind} re-load check {k}: card PPL {a:.4f} reloaded PPL {b:.4f} -> "
                f"{'MATCH' if ok else 'MISMATCH'}")
            if not ok:
                raise SystemExit(f"{kind}: re-loaded PPL differs from the in-memory PPL")
            if not args.tiny and b > uniform_ppl / args.min_ppl_ratio:
                failures.append(f"{kind}: {k} PPL {b:.1f} is not far below uniform {uniform_ppl:.0f}")
                log("WARNING " + failures[-1])
        if device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        del m2

        write_card(out_dir, kind, cfg, rec, evals, samples, fp, args, size_mb, routing, command)
        train_log = {k: rec[k] for k in rec}
        train_log.update(val_loss_fp32=evals["val_loss"], heldout=evals["heldout"],
                         reload_heldout=evals["reload_heldout"], samples=samples, routing=routing,
                         seed=args.seed, command=command, fingerprint=fp)
        (out_dir / "training_log.json").write_text(json.dumps(train_log, indent=1), encoding="utf-8")
        results[kind] = {"size_mb": round(size_mb, 2), "val_loss": round(evals["val_loss"], 4),
                         **{f"ppl_{k}": round(v["ppl"], 3) for k, v in evals["heldout"].items()},
                         "steps": rec["steps"], "best_step": rec["best_step"],
                         "tokens_seen": rec["tokens_seen"], "wall_time_s": rec["wall_time_s"]}
        summary["models"][kind] = results[kind]
    (args.out_dir / "zoo_summary.json").write_text(json.dumps(summary, indent=1), encoding="utf-8")
    log("summary " + json.dumps(results))
    log(f"total time {time.perf_counter() - t0:.0f}s")
    if failures:
        log("FAILED: " + "; ".join(failures))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
