"""A sticky CUDA error (an illegal memory access: every later CUDA call of the process fails the same way) stops
the suite after one error result instead of writing an error for every later run; --resume then runs the rest.
On CPU the lost context is simulated (`runner._cuda_lost`) with a crash planted in one eval."""

from __future__ import annotations

import json

from evalharness import runner
from tests.faults.support import cli, model, token_corpus, write_suite


def test_a_lost_cuda_context_stops_the_suite_and_resume_runs_the_rest(tmp_path, capsys, monkeypatch):
    corpus = token_corpus(tmp_path / "c.json")
    models = [{"name": n, "path": str(model(tmp_path, n, seed=i)), "corpus": str(corpus)}
              for i, n in enumerate(("m1", "m2"))]
    suite = write_suite(tmp_path / "s.yaml", models, recipes=("fp32", "bf16"))
    out = tmp_path / "out"
    real_run_eval = runner.run_eval
    lost = {"on": True}

    def crashing_run_eval(name, ctx, cfg):  # the first run's first eval dies as a kernel fault would
        if lost["on"]:
            raise RuntimeError("Triton Error [CUDA]: an illegal memory access was encountered")
        return real_run_eval(name, ctx, cfg)

    monkeypatch.setattr(runner, "run_eval", crashing_run_eval)
    monkeypatch.setattr(runner, "_cuda_lost", lambda device: lost["on"])
    code, text = cli(capsys, "run", suite, "--out", out, "--no-tracking")
    assert code == 1
    written = sorted(p.name for p in out.glob("m*.json"))
    assert written == ["m1__fp32__default__cpu-emulated.json"], written  # one error result, not four
    assert json.loads((out / written[0]).read_text())["status"] == "error"
    assert "stopped: the CUDA context is unusable after m1__fp32__default__cpu-emulated crashed" in text
    assert "3 run(s) did not run" in text and "--resume" in text

    lost["on"] = False  # the cause fixed: --resume runs the crashed run and the three that never ran
    code, text = cli(capsys, "run", suite, "--out", out, "--no-tracking", "--resume")
    assert code == 0, text
    docs = {p.name: json.loads(p.read_text()) for p in out.glob("m*.json")}
    assert len(docs) == 4 and all(d["status"] == "ok" for d in docs.values())
