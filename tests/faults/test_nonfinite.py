"""Non-finite outputs are never "perfect". Row of the fault table: engine output all NaN gave
`layer_error.*.rel_l2 = 0`, `cosine = 1`, `sqnr_db = 300`, and a suite gated on rel_l2 alone PASSed."""

from __future__ import annotations

import math

from safetensors.torch import load_file, save_file

from evalharness.report import results_table
from evalharness.results import load_result
from tests.faults.support import cli, model, token_corpus, write_suite

KEY = "m__r__default__cpu-emulated"
REL_L2_ONLY = {"rules": [{"metric": "layer_error.*.rel_l2", "direction": "lower", "abs_tol": 1e-4, "rel_tol": 0.5}]}


def test_nan_outputs_fail_a_gate_on_rel_l2_alone(tmp_path, capsys):
    """A checkpoint with huge embeddings: recipe `r` = fp32 is finite and becomes the baseline; recipe `r` with an
    fp16 residual stream overflows to NaN/Inf. Its error statistics are NaN (stored as null), the nonfinite
    fraction is reported per tap and for the run, the run table shows it, and the rel_l2-only gate FAILs."""
    folder = model(tmp_path, "m")
    w = load_file(str(folder / "model.safetensors"))
    w["model.embed_tokens.weight"] = w["model.embed_tokens.weight"] * 1e6
    save_file(w, str(folder / "model.safetensors"), metadata={"format": "pt"})
    entry = {"name": "m", "path": str(folder), "corpus": str(token_corpus(tmp_path / "c.json"))}
    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    good.write_text("name: r\nextends: fp32\n")
    bad.write_text("name: r\nextends: fp32\nresidual: fp16\n")
    suite = write_suite(tmp_path / "s.yaml", [entry], recipes=(str(good),), gate=REL_L2_ONLY)
    base = tmp_path / "baselines"
    assert cli(capsys, "run", suite, "--out", tmp_path / "good", "--no-tracking")[0] == 0
    assert cli(capsys, "baseline", "update", tmp_path / "good", "--baselines", base)[0] == 0
    code, text = cli(capsys, "run", suite, "--out", tmp_path / "bad", "--no-tracking", "--set", f"recipe={bad}")
    assert code == 0, text
    doc = load_result(tmp_path / "bad" / f"{KEY}.json")
    m = doc["metrics"]
    for stat in ("rel_l2", "cosine", "sqnr_db", "max_abs"):
        assert m[f"layer_error.logits.{stat}"] is None, stat  # NaN, stored as null
    assert m["layer_error.logits.nonfinite_frac"] == 1.0 and m["layer_error.nonfinite_frac"] > 0
    assert m["layer_error.max_rel_l2"] is None
    assert m["ppl_kld.kld_mean"] is None and m["ppl_kld.nonfinite_frac"] == 1.0
    assert not math.isnan(m["ppl_kld.ppl_ref"])  # the reference's perplexity stays a number
    row = next(ln for ln in text.splitlines() if ln.startswith(KEY))
    assert "ok (NaN/Inf)" in row and "nonfinite" in text.splitlines()[text.splitlines().index(row) - 1]
    code, text = cli(capsys, "gate", tmp_path / "bad", "--baselines", base)
    assert code == 1, text
    assert "FAIL" in text and "layer_error.logits.rel_l2" in text and "NaN/Inf" in text


def test_partly_nonfinite_ppl_kld_is_nan_not_the_finite_tokens_alone():
    """One NaN row among finite ones: every engine statistic of ppl_kld is NaN (no mean over the finite tokens
    alone); the per-window share of NaN rows is kept."""
    import torch

    from evalharness.data import Windows
    from evalharness.evals import EvalContext
    from evalharness.evals.ppl_kld import run_ppl_kld

    torch.manual_seed(0)
    logits = torch.randn(2, 8, 11)

    class Model:
        def __init__(self, bad: bool):
            self.bad = bad

        def logits(self, tokens, **kw):
            out = logits[: tokens.shape[0]].clone()
            if self.bad:
                out[0, 3] = float("nan")
            return out

    class Ctx(EvalContext):
        def windows(self, *a, **kw):
            return Windows(torch.zeros(2, 8, dtype=torch.long), torch.ones(2, 8, dtype=torch.long))

    cfg = {"seq_len": 8, "stride": None, "max_windows": 2, "max_tokens": 100, "bos": True, "ref_topk": None}
    ctx = Ctx(engine=Model(True), reference=Model(False), tokenizer=None, corpus="x", vocab_size=11, batch_size=2,
              seed=0, cache={})
    m, s = run_ppl_kld(ctx, cfg)
    assert math.isnan(m["kld_mean"]) and math.isnan(m["top1_agree"]) and math.isnan(m["ppl_ratio"])
    assert m["nonfinite_frac"] == 1 / 16 and s["window_nonfinite_frac"] == [1 / 8, 0.0]
    assert math.isfinite(m["ppl_ref"])


def test_results_table_shows_nonfinite_runs():
    """The run table gets a `nonfinite` column, and the run's status says NaN/Inf, only when a run had them."""
    ok = {"run_key": "a", "status": "ok", "metrics": {"ppl_kld.nonfinite_frac": 0.0, "ppl_kld.kld_mean": 0.1}}
    nan = {"run_key": "b", "status": "ok", "metrics": {"layer_error.x.nonfinite_frac": 0.25,
                                                        "ppl_kld.kld_mean": None}}
    assert "nonfinite" not in results_table([ok])
    lines = results_table([ok, nan]).splitlines()
    assert "nonfinite" in lines[0] and lines[2].split()[1:3] == ["ok", "(NaN/Inf)"] and "0.25" in lines[2]
