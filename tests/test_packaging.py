"""The package as a user installs it.

* The declared dependency floors are met by the versions the tests run on (a floor above them would be untested).
* ``evalharness report`` and ``evalharness trend`` import nothing outside the declared dependencies and theirs, so a
  plain ``pip install`` of the package runs them.
* A wheel built from the sources, installed into a fresh virtualenv and run from a folder outside the source tree,
  runs a task suite offline from the data dir (lm-eval's arc_easy and mmlu_abstract_algebra on zoo-llama) and its
  accuracies and per-document results equal those of lm-eval's own evaluator on the same adapter and documents;
  ``report`` works on its results.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO

tomllib = pytest.importorskip("tomllib")
requirements = pytest.importorskip("packaging.requirements")
from packaging.utils import canonicalize_name  # noqa: E402


def _project() -> dict:
    """pyproject.toml's [project] table."""
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def _applies(req) -> bool:
    """Whether a requirement's marker holds here (no extra selected)."""
    return req.marker is None or req.marker.evaluate({"extra": ""})


def test_installed_versions_meet_the_floors():
    """Every runtime and test requirement is installed at a version its specifier admits."""
    project = _project()
    reqs = [requirements.Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["test"]]
    bad = []
    for req in filter(_applies, reqs):
        try:
            version = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            bad.append(f"{req}: not installed")
            continue
        if not req.specifier.contains(version, prereleases=True):
            bad.append(f"{req}: installed {version}")
    assert not bad, "declared requirements the test environment does not meet:\n" + "\n".join(bad)


def _closure(names: list[str]) -> set[str]:
    """The installed distributions `names` require, recursively (markers evaluated, no extras)."""
    seen: set[str] = set()
    todo = [canonicalize_name(n) for n in names]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            reqs = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        todo += [canonicalize_name(r.name) for r in map(requirements.Requirement, reqs) if _applies(r)]
    return seen


# Run in a fresh interpreter: `report` and `trend` with every top-level module outside ALLOWED (and outside the standard library) made unimportable
# (as in an environment where only the declared dependencies were installed); prints the exit codes and what was
# refused (optional imports, which must not matter).
BLOCKED_RUN = """
import importlib.machinery, json, sys, sysconfig
allowed, results, out = set(json.loads(sys.argv[1])), sys.argv[2], sys.argv[3]
allowed |= {m.split(".")[0] for m in sys.modules} | set(sys.stdlib_module_names)
stdlib = [sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"] + "/lib-dynload"]
refused = set()


class Refuse:
    def find_spec(self, name, path=None, target=None):
        top = name.split(".")[0]
        if top not in allowed and importlib.machinery.PathFinder.find_spec(top, stdlib) is None:
            refused.add(top)
            raise ModuleNotFoundError(f"No module named {name!r} (not a declared dependency)", name=name)
        return None


sys.meta_path.insert(0, Refuse())
from evalharness.cli import main
codes = [main(["report", results, "--out", out + "/report"]), main(["trend", results, "--out", out + "/trend"])]
print(json.dumps({"codes": codes, "refused": sorted(refused)}))
"""


def test_report_and_trend_need_only_declared_packages(tmp_path):
    """`report` and `trend` on a results folder, in an interpreter that can import only the standard library, this
    package and the distributions its declared dependencies bring (matplotlib among them): both succeed and write
    their plots."""
    from tests.evalharness.test_results_report import _result, _write_dir

    results = _write_dir(tmp_path / "2026-11-28", [
        _result("zoo-llama", "fp32", 0.0, 1.0, [0.0, 0.0]),
        _result("zoo-llama", "fp8-block", 0.005, 1.003, [0.02, 0.03], tasks={"arc_easy": (-0.01, -0.03, 0.01)})])
    declared = _closure([requirements.Requirement(r).name for r in _project()["dependencies"]])
    assert "matplotlib" in declared
    allowed = {"evalharness", "engine"} | {m for m, dists in metadata.packages_distributions().items()
                                          if any(canonicalize_name(d) in declared for d in dists)}
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", BLOCKED_RUN, json.dumps(sorted(allowed)), str(results),
                          str(tmp_path)], cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    doc = json.loads(out.stdout.strip().splitlines()[-1])
    assert doc["codes"] == [0, 0], out.stdout[-2000:] + out.stderr[-2000:]
    assert (tmp_path / "report" / "report.md").is_file() and list((tmp_path / "report").glob("*.png"))
    assert list((tmp_path / "trend").glob("*.png"))


WHEEL_SUITE = {
    "name": "wheel-tasks", "backend": "cpu-emulated", "seed": 0,
    "models": [{"name": "zoo-llama", "path": str(REPO / "zoo" / "zoo-llama"),
                "corpus": str(REPO / "zoo" / "zoo-llama" / "heldout_sample.json")}],
    "recipes": ["fp8-block"], "serving": [{"name": "default", "batch_size": 8}],
    "evals": {"tasks": {"tasks": ["arc_easy", "mmlu_abstract_algebra"],
                        "limit": {"arc_easy": 12, "mmlu_abstract_algebra": 2},
                        "num_fewshot": {"arc_easy": 0, "mmlu_abstract_algebra": 5}}},
}

# Run with the virtualenv's interpreter: lm-eval's own evaluator on the same model adapter, tasks and documents.
LM_EVAL_SIDE = """
import json, sys
import evalharness, lm_eval
from engine.api import Engine
from engine.loading import load_model
from engine.model import Transformer
from engine.tokenizer import load_tokenizer
from evalharness.lm_adapter import HarnessLM
from evalharness.reference import ReferenceLM
from evalharness.taskdata import task_manager

suite, data_dir = json.loads(sys.argv[1]), sys.argv[2]
model, tasks = suite["models"][0], suite["evals"]["tasks"]
loaded = load_model(model["path"])
tok = load_tokenizer(None, loaded.directory)
models = {"eng": Engine(Transformer(loaded.cfg, loaded.weights), "fp8-block", backend="cpu-emulated"),
          "ref": ReferenceLM(loaded)}
tm = task_manager(tasks["tasks"], [], data_dir)
out = {"evalharness": evalharness.__file__}
for side, m in models.items():
    for task in tasks["tasks"]:
        res = lm_eval.simple_evaluate(model=HarnessLM(m, tok, batch_size=8), tasks=[task], task_manager=tm,
                                      limit=tasks["limit"][task], num_fewshot=tasks["num_fewshot"][task],
                                      bootstrap_iters=0)
        docs = sorted(res["samples"][task], key=lambda d: d["doc_id"])
        out[f"{task}.acc_{side}"] = res["results"][task]["acc,none"]
        out[f"{task}.correct_{side}"] = [int(d["acc"]) for d in docs]
print(json.dumps(out))
"""


def _wheel(tmp: Path) -> Path:
    """A wheel built from a copy of the sources that a clean checkout has (no build artefacts of this tree)."""
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    for pkg in ("engine", "evalharness"):
        shutil.copytree(REPO / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp / "dist"), str(src)], check=True, capture_output=True, timeout=300)
    (wheel,) = (tmp / "dist").glob("evalharness-*.whl")
    return wheel


@pytest.mark.slow
def test_wheel_in_a_fresh_virtualenv_runs_lm_eval_tasks_offline(tmp_path, data_dir):
    """From an installed wheel, outside the source tree and offline: `evalharness run` with lm-eval's arc_easy and
    mmlu_abstract_algebra (5-shot) on zoo-llama under fp8-block, accuracies and per-document correctness equal to
    lm-eval's own evaluator's for the engine and the reference; then `evalharness report`."""
    wheel = _wheel(tmp_path)
    with zipfile.ZipFile(wheel) as zf:  # the package data the harness reads at run time
        names = set(zf.namelist())
    assert {"evalharness/taskdata/datasets.yaml", "engine/recipes/fp8-block.yaml",
            "engine/kernels/configs/nvidia-h200.json", "evalharness/builtin/tiny-llama/config.json"} <= names, sorted(n for n in names if not n.endswith(".py"))
    venv = tmp_path / "venv"
    # The virtualenv reuses the installed torch / transformers / lm-eval (no downloads); the package is the wheel's.
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(venv)], check=True,
                   timeout=120)
    py = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps", "--no-index",
                    "--ignore-installed", str(wheel)], check=True, capture_output=True, timeout=300)
    work = tmp_path / "work"
    work.mkdir()
    (work / "suite.yaml").write_text(yaml.safe_dump(WHEEL_SUITE, sort_keys=False))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "EVALHARNESS_DATA_DIR")}
    env |= {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "PATH": f"{venv / 'bin'}:{env.get('PATH', '')}"}

    def run(*cmd: str) -> subprocess.CompletedProcess:
        p = subprocess.run(list(cmd), cwd=work, env=env, capture_output=True, text=True, timeout=900)
        assert p.returncode == 0, f"{cmd}: exit {p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}"
        return p

    run(str(venv / "bin" / "evalharness"), "run", "suite.yaml", "--data-dir", str(data_dir), "--out", "out",
        "--no-tracking")
    result = json.loads((work / "out" / "zoo-llama__fp8-block__default__cpu-emulated.json").read_text())
    assert result["status"] == "ok", result.get("error")
    lm = json.loads(run(str(py), "-c", LM_EVAL_SIDE, json.dumps(WHEEL_SUITE), str(data_dir)).stdout.splitlines()[-1])
    assert lm.pop("evalharness").startswith(str(venv))  # the wheel's package, not this checkout
    for key, want in lm.items():
        got = result["samples"]["tasks"][key] if ".correct_" in key else result["metrics"][f"tasks.{key}"]
        assert got == want, key
    assert 0 < sum(lm["arc_easy.correct_ref"]) < 12  # some right, some wrong: equality is not trivial
    run(str(venv / "bin" / "evalharness"), "report", "out", "--out", "report")
    assert "arc_easy" in (work / "report" / "report.md").read_text()
