"""The mutation fixture (`evalharness.mutations.patched`): every CPU mutation of the catalog changes what its
patched function returns on a small input, and the original is back after the block."""

from __future__ import annotations

import importlib

import pytest
import torch

from engine.config import MoeConfig
from evalharness.errors import SuiteError
from evalharness.mutations import FAULTS, load_mutations, patched


def _x(rows: int = 4, k: int = 256) -> torch.Tensor:
    """Rows and 128-blocks of different magnitudes (so neighbouring scales differ)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, k, generator=g)
    return x * torch.logspace(0, 2, rows)[:, None] * torch.cat([torch.ones(128), 8 * torch.ones(k - 128)])


def _quant(spec: str, x: torch.Tensor | None = None):
    from engine.formats import quantize

    return lambda: quantize(_x() if x is None else x, spec).dequantize()


def _mx_overflow() -> torch.Tensor:
    x = torch.ones(1, 32)
    x[0, 0] = 500.0  # amax 500: X = 2**0, and 500 > 448 saturates (the OCP MX floor rule)
    x[0, 1] = -480.0
    return x


def _subnormal() -> torch.Tensor:
    x = torch.full((1, 128), 1.0e-3)
    x[0, 0] = 448.0  # scale 1: 1e-3 is an E4M3 subnormal (below 2**-6)
    return x


def _linear():
    import engine.numerics as N

    g = torch.Generator().manual_seed(1)
    a, w = torch.randn(8, 256, generator=g), torch.randn(16, 256, generator=g)
    return lambda: N.F.linear(a, w)


def _softmax():
    import engine.numerics as N

    s = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(2)) * 3
    return lambda: N.torch.softmax(s, dim=-1)


def _kv_store():
    from engine.numerics import Numerics
    from engine.recipe import load_recipe

    nx = Numerics(load_recipe("fp8-kv"))
    k = torch.randn(1, 4, 8, 16, generator=torch.Generator().manual_seed(3)) * torch.tensor([1, 10, 100, 1000.0])[
        None, :, None, None]
    return lambda: nx.kv_store(k, "kv.k", "model.layers.0.self_attn")


def _paged(copy: bool):
    from engine.kernels.paged_cache import PagedKVCache

    def run():
        c = PagedKVCache(1, 16, 16, 2, 8, dtype=torch.float32, device="cpu")
        g = torch.Generator().manual_seed(4)
        for s in (0, 1):
            c.allocate(s, 64)
            c.write(0, [s], [0], torch.randn(1, 2, 64, 8, generator=g), torch.randn(1, 2, 64, 8, generator=g))
        if copy:
            c.copy_prefix(1, 0, 32)
        return torch.cat(c.gather(0, 0, 64), dim=-1)
    return run


def _route():
    import engine.numerics as N

    cfg = MoeConfig(num_experts=4, top_k=1, intermediate_size=8)
    logits = torch.tensor([[1.0, 1.0, 0.0, 0.0], [0.0, 2.0, 2.0, 1.0]])  # exact ties
    return lambda: N.route(logits, cfg)[1].float()


def _run_experts():
    from engine.numerics import Numerics
    from engine.recipe import load_recipe

    g = torch.Generator().manual_seed(5)
    experts = [tuple(torch.randn(8, 16, generator=g) if i < 2 else torch.randn(16, 8, generator=g)
                     for i in range(3)) for _ in range(3)]
    xs = torch.randn(6, 16, generator=g)
    nx = Numerics(load_recipe("fp32"))
    return lambda: nx.run_experts(xs, [2, 0, 4], experts, "model.layers.1.mlp")


def _dispatch():
    import engine.numerics as N

    ids = torch.tensor([[2, 0], [1, 0], [2, 1]])
    return lambda: N.dispatch_plan(ids, 3).order.float()


def _kv_append():
    from engine.attention import KVCache

    def run():
        c = KVCache([torch.zeros(1, 1, 8, 4)], [torch.zeros(1, 1, 8, 4)])
        c.append(0, torch.ones(1, 1, 4, 4), torch.ones(1, 1, 4, 4))
        c.length = 4
        k, v = c.append(0, 2 * torch.ones(1, 1, 4, 4), 3 * torch.ones(1, 1, 4, 4))
        return torch.cat([k, v], dim=-1)
    return run


PROBES = {
    "q-round-toward-zero": _quant("e4m3:1x128"),
    "q-scale-wrong-group": _quant("e4m3:1x128"),
    "q-e8m0-exponent-off-by-one": _quant("mxfp8"),
    "q-saturate-wraps": _quant("mxfp8", _mx_overflow()),
    "q-flush-subnormals": _quant("e4m3:1x128", _subnormal()),
    "gemm-accum-bf16": _linear(),
    "gemm-drop-split": _linear(),
    "gemm-scale-wrong-block": _quant("e4m3:1x128"),
    "attn-softmax-bf16": _softmax(),
    "attn-k-scale-per-tensor": _kv_store(),
    "attn-kv-page-off-by-one": _paged(copy=False),
    "attn-stale-prefix-page": _paged(copy=True),
    "moe-tie-break": _route(),
    "moe-drop-expert": _run_experts(),
    "moe-unsorted-combine": _dispatch(),
    "rt-chunk-boundary": _kv_append(),
}


def _target_value(target: str):
    mod, _, path = target.partition(":")
    obj = importlib.import_module(mod)
    for p in path.split("."):
        obj = getattr(obj, p)
    return obj


CPU = [m for m in load_mutations() if m.device == "cpu"]


def test_catalog_covers_the_issue():
    ms = load_mutations()
    assert len(ms) >= 15 + 6 and len(CPU) >= 15
    assert {m.id for m in CPU} == set(PROBES)  # every CPU mutation has a probe below
    assert all(m.fault in FAULTS for m in CPU)
    assert all(m.device == "gpu" for m in ms if m not in CPU)  # tests/test_kernel_mutations.py checks those


@pytest.mark.parametrize("m", CPU, ids=[m.id for m in CPU])
def test_fault_changes_output_and_is_undone(m):
    probe = PROBES[m.id]
    before_fn = _target_value(m.target)
    clean = probe()
    with patched(m):
        assert _target_value(m.target) is not before_fn
        faulty = probe()
    assert _target_value(m.target) is before_fn
    assert faulty.shape == clean.shape
    assert not torch.equal(faulty, clean), f"{m.id}: the fault did not change {m.target}'s output"
    assert torch.equal(probe(), clean)


def test_patch_is_undone_after_an_error():
    m = next(m for m in CPU if m.id == "gemm-drop-split")
    import engine.numerics as N

    f = N.F
    with pytest.raises(RuntimeError):
        with patched(m):
            assert N.F is not f
            raise RuntimeError("boom")
    assert N.F is f


def test_gpu_entries_are_listed_not_run_without_cuda(tmp_path):
    """Without CUDA the native-kernel entries are listed as `gpu` (nothing runs for them, no suite is loaded)."""
    from evalharness.selftest_mutations import run_mutations, table

    gpu = [m.id for m in load_mutations() if m.device == "gpu"]
    report = run_mutations(tmp_path, only=gpu, cuda=False, log=lambda s: None)
    assert report["gpu"] == gpu and report["mutations_run"] == 0 and report["passed"]
    assert "gpu (not run: no CUDA) 6" in table(report)


def test_catalog_errors_name_entry_and_key(tmp_path):
    p = tmp_path / "m.yaml"
    p.write_text("mutations:\n  - {id: a, target: 'engine.numerics:route', fault: nope, baseline: fp8-block, what: x}\n")
    with pytest.raises(SuiteError, match=r"mutations\[0\]: fault 'nope'"):
        load_mutations(p)


@pytest.mark.slow  # ~20 s of CPU: the baseline, two nulls and two mutated runs through the real runner and gate
def test_selftest_mutations_end_to_end(tmp_path, capsys):
    """`evalharness selftest --mutations` on two faults at tiny sizes: one caught by an op-local rule, one end to
    end; the unmutated re-run and seed-1 nulls pass; outcomes and the report are on disk."""
    import json

    from evalharness.cli import main

    out = tmp_path / "mut"
    code = main(["selftest", "--mutations", "--only", "gemm-drop-split,attn-softmax-bf16", "--models", "tiny-llama",
                 "--set", "evals.ppl_kld.max_windows=4", "--set", "evals.ppl_kld.seq_len=16",
                 "--set", "evals.layer_error.windows=1", "--set", "evals.layer_error.seq_len=16", "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    report = json.loads((out / "mutations.json").read_text())
    by_id = {e["id"]: e for e in report["entries"]}
    assert report["false_alarms"] == 0 and report["nulls"] == 2 and report["errors"] == 0
    assert by_id["attn-softmax-bf16"]["status"] == "caught"
    assert by_id["attn-softmax-bf16"]["caught_by"]["metric"] == "layer_error.local.attn.softmax.rel_l2"
    assert by_id["gemm-drop-split"]["status"] == "caught"
    assert by_id["gemm-drop-split"]["effect"]["z"] > 3
    assert by_id["gemm-drop-split"]["n_min"]["n_min"] >= 2
    assert (out / "smoke" / "mutations" / "gemm-drop-split.json").exists()
    assert "caught 2/2" in printed and "false alarms 0/2" in printed
