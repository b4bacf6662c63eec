"""pytest plugin: `pytest -m numerics` in your repo (registered as the `pytest11` entry point `evalharness`).

Installing `evalharness` is enough: pytest loads this plugin, which

* registers the `numerics` marker;
* adds the options `--numerics-suite PATH`, `--numerics-baselines DIR`,
  `--numerics-update-baselines`, `--numerics-data-dir DIR`,
  `--numerics-set KEY=VALUE` (repeatable, same as `evalharness run --set`)
  and `--numerics-out DIR` (keep the results; finished ones are reused), with
  ini defaults `numerics_suite`, `numerics_baselines`, `numerics_data_dir`,
  `numerics_set` (a list, applied before the command line's) in
  `[tool.pytest.ini_options]`; relative ini paths are relative to the ini file;
* provides the fixtures `numerics_suite` (the loaded `Suite`),
  `numerics_results` (session: the suite run once, result docs by run_key,
  with `.dir`) and `numerics_engine(model, recipe)` (a factory of
  `(engine, reference)` pairs, models loaded once per session);
* and the assertion helpers `assert_metric(...)` and
  `assert_gate_passes(results_dir)`, whose failures print the gate's evidence
  lines (value, baseline, delta, threshold, CI, p).

With `--numerics-update-baselines` the session writes the results as
baselines (after printing the diff) instead of gating: `assert_gate_passes`
and the baseline part of `assert_metric` then pass.

Example (a test module in your repo)::

    import pytest
    from evalharness.pytest_plugin import assert_gate_passes, assert_metric

    pytestmark = pytest.mark.numerics

    def test_gate(numerics_results):
        assert_gate_passes(numerics_results)

    def test_fp8_kld(numerics_results):
        r = numerics_results["my-model__fp8-block__default__cpu-emulated"]
        assert_metric(r, "ppl_kld.kld_mean", max=0.05, rel_to_baseline=0.25)
"""

from __future__ import annotations

import builtins
import dataclasses
import difflib
import sys
from pathlib import Path
from typing import Any, Callable, NamedTuple

import pytest

MARKER = "numerics: numerics checks of an engine against the FP32 reference (select with -m numerics)"
_STACK: list[pytest.Config] = []  # active sessions, innermost last (pytester runs nest in-process)
_OPTIONS = pytest.StashKey["NumericsOptions"]()
_REPORT = pytest.StashKey[list]()


@dataclasses.dataclass(frozen=True)
class NumericsOptions:
    """The plugin's settings for one pytest session (command line over ini)."""

    suite: Path | None
    baselines: Path
    data_dir: str | None
    sets: tuple[str, ...]
    update_baselines: bool
    out: Path | None


class EnginePair(NamedTuple):
    """What `numerics_engine(model, recipe)` returns: unpack as `engine, reference = ...`."""

    engine: Any  # engine.api.Engine
    reference: Any  # evalharness.reference.ReferenceLM


class NumericsResults(dict):
    """Result docs keyed by run_key, plus the results folder (`.dir`) and the suite (`.suite`)."""

    def __init__(self, docs: dict[str, dict], results_dir: Path, suite: Any):
        """Hold `docs` (run_key -> result document) written to `results_dir` by `suite`."""
        super().__init__(docs)
        self.dir = Path(results_dir)
        self.suite = suite

    def __fspath__(self) -> str:
        """So that `assert_gate_passes(numerics_results)` and `Path(numerics_results)` work."""
        return str(self.dir)


# ---------------------------------------------------------------- hooks

def pytest_addoption(parser: pytest.Parser) -> None:
    """The `--numerics-*` options and their ini defaults."""
    g = parser.getgroup("numerics", "evalharness numerics (engine vs FP32 reference)")
    g.addoption("--numerics-suite", default=None, metavar="PATH",
                help="suite YAML run by the numerics_results fixture (ini: numerics_suite)")
    g.addoption("--numerics-baselines", default=None, metavar="DIR",
                help="baselines folder for the gate (ini: numerics_baselines; default: <rootdir>/baselines)")
    g.addoption("--numerics-update-baselines", action="store_true", default=False,
                help="write the session's results as baselines instead of gating")
    g.addoption("--numerics-data-dir", default=None, metavar="DIR",
                help="shared data folder for ${data_dir} in the suite (ini: numerics_data_dir)")
    g.addoption("--numerics-set", action="append", default=[], metavar="KEY=VALUE",
                help="override a suite field, like `evalharness run --set` (repeatable; after ini numerics_set)")
    g.addoption("--numerics-out", default=None, metavar="DIR",
                help="keep the results here (finished results are reused) instead of a tmp dir")
    parser.addini("numerics_suite", "suite YAML for the numerics fixtures (relative to the ini file)", default=None)
    parser.addini("numerics_baselines", "baselines folder for the numerics gate (relative to the ini file)",
                  default=None)
    parser.addini("numerics_data_dir", "shared data folder for the numerics suite", default=None)
    parser.addini("numerics_set", "suite overrides KEY=VALUE applied before --numerics-set", type="linelist",
                  default=[])


def _ini_path(config: pytest.Config, value: str | None) -> Path | None:
    """An ini path resolved against the ini file's folder (else the rootdir)."""
    if not value:
        return None
    p = Path(value).expanduser()
    base = config.inipath.parent if config.inipath else config.rootpath
    return p if p.is_absolute() else (base / p)


def _options(config: pytest.Config) -> NumericsOptions:
    """Resolve the session's settings: command line first, then ini, then defaults."""
    opt = config.getoption
    suite = (Path(opt("--numerics-suite")) if opt("--numerics-suite")
             else _ini_path(config, config.getini("numerics_suite")))
    baselines = (Path(opt("--numerics-baselines")) if opt("--numerics-baselines")
                 else _ini_path(config, config.getini("numerics_baselines")) or config.rootpath / "baselines")
    data_dir = opt("--numerics-data-dir") or (str(_ini_path(config, config.getini("numerics_data_dir")))
                                              if config.getini("numerics_data_dir") else None)
    sets = tuple(config.getini("numerics_set") or []) + tuple(opt("--numerics-set") or [])
    out = Path(opt("--numerics-out")) if opt("--numerics-out") else None
    return NumericsOptions(suite=suite, baselines=baselines, data_dir=data_dir, sets=sets,
                           update_baselines=bool(opt("--numerics-update-baselines")), out=out)


def pytest_configure(config: pytest.Config) -> None:
    """Register the marker and make this session the one the assertion helpers default to."""
    config.addinivalue_line("markers", MARKER)
    config.stash[_OPTIONS] = _options(config)
    config.stash[_REPORT] = []
    _STACK.append(config)


def pytest_unconfigure(config: pytest.Config) -> None:
    """Forget the session."""
    if config in _STACK:
        _STACK.remove(config)


def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:
    """Say what the numerics session did (baselines written, results kept)."""
    lines = config.stash.get(_REPORT, [])
    if lines:
        terminalreporter.section("numerics")
        for line in lines:
            terminalreporter.write_line(line)


def _current() -> NumericsOptions | None:
    """The innermost active session's settings, or None outside pytest."""
    return _STACK[-1].stash[_OPTIONS] if _STACK else None


# ---------------------------------------------------------------- fixtures

@pytest.fixture(scope="session")
def numerics_options(pytestconfig: pytest.Config) -> NumericsOptions:
    """The resolved `--numerics-*` settings of this session."""
    return pytestconfig.stash[_OPTIONS]


@pytest.fixture(scope="session")
def numerics_suite(numerics_options: NumericsOptions):
    """The loaded `evalharness.suite.Suite` (with `--numerics-set` overrides); skips when none is configured."""
    from evalharness.errors import HarnessError
    from evalharness.suite import load_suite

    if numerics_options.suite is None:
        pytest.skip("no numerics suite: pass --numerics-suite PATH or set numerics_suite in [tool.pytest.ini_options]")
    try:
        return load_suite(numerics_options.suite, sets=list(numerics_options.sets), data_dir=numerics_options.data_dir)
    except HarnessError as exc:
        pytest.fail(f"numerics suite: {exc}", pytrace=False)


@pytest.fixture(scope="session")
def numerics_results(numerics_suite, numerics_options: NumericsOptions, tmp_path_factory, pytestconfig
                     ) -> NumericsResults:
    """Run the suite once per session; result docs by run_key (`.dir` is the results folder).

    With `--numerics-update-baselines` the results are also written as baselines.
    """
    from evalharness.results import load_result
    from evalharness.runner import run_suite

    out = numerics_options.out or tmp_path_factory.mktemp("numerics-results")
    outcomes = run_suite(numerics_suite, out, resume=numerics_options.out is not None,
                         log=lambda s: print(s, file=sys.stderr))
    docs = {o.key: load_result(o.path) for o in outcomes}
    report = pytestconfig.stash[_REPORT]
    report.append(f"suite '{numerics_suite.name}': {len(docs)} result(s) in {out}")
    if numerics_options.update_baselines:
        from evalharness.baselines import update_baselines

        diff: list[str] = []
        written = update_baselines(out, numerics_options.baselines, log=diff.append)
        report.extend(diff)
        report.append(f"--numerics-update-baselines: {len(written)} baseline file(s) written to "
                      f"{numerics_options.baselines}")
    return NumericsResults(docs, Path(out), numerics_suite)


class _EngineFactory:
    """`numerics_engine(model, recipe)`: (engine, reference) pairs; each model and reference loaded once."""

    def __init__(self, request: pytest.FixtureRequest):
        """Remember the request (to reach `numerics_suite` only when a model is named by suite name)."""
        self._request = request
        self._models: dict[tuple[str, str], tuple[Any, Any]] = {}

    def _source(self, model: str) -> tuple[Any, str]:
        """(`engine.loading.ModelSource`, backend) for a suite model name, `builtin:NAME`, an HF dir / id or
        `llama2c:FILE` (a suite's model names first, then the engine's source grammar)."""
        from evalharness.fingerprint import model_source

        backend = "cpu-emulated"
        opts = self._request.getfixturevalue("numerics_options")
        if opts.suite is not None and not model.startswith("builtin:") and not Path(model).exists():
            suite = self._request.getfixturevalue("numerics_suite")
            for spec in suite.runs:
                if spec.model["name"] == model:
                    model, backend = spec.model["path"], spec.backend
                    break
        return model_source({"path": model}), backend

    def __call__(self, model: str, recipe: Any, *, backend: str | None = None) -> EnginePair:
        """The engine for `recipe` (name, YAML path or Recipe) on `model`, and that model's FP32 reference."""
        import torch

        from engine.api import Engine
        from engine.loading import load_model
        from engine.model import Transformer
        from evalharness.reference import ReferenceLM

        source, suite_backend = self._source(model)
        backend = backend or suite_backend
        device = "cuda" if backend.startswith("cuda") else "cpu"
        key = (source, device)
        if key not in self._models:
            loaded = load_model(source)
            torch.manual_seed(0)
            self._models[key] = (Transformer(loaded.cfg, loaded.weights, where=loaded.source).to(device),
                                 ReferenceLM(loaded, device=device))
        base, reference = self._models[key]
        return EnginePair(Engine(base, recipe, backend=backend), reference)


@pytest.fixture(scope="session")
def numerics_engine(request: pytest.FixtureRequest) -> Callable[..., EnginePair]:
    """Factory: `engine, reference = numerics_engine("tiny-llama", "fp8-block")`.

    `model` is a model name of the numerics suite, `builtin:NAME`, an HF model
    folder or hub id, or `llama2c:FILE`; `recipe` a named recipe, a recipe YAML
    path or an `engine.recipe.Recipe`.
    """
    return _EngineFactory(request)


# ---------------------------------------------------------------- assertion helpers

def _as_doc(result: Any) -> dict[str, Any]:
    """A result document from a dict or a result file path."""
    if isinstance(result, dict):
        return result
    from evalharness.results import load_result

    return load_result(result)


def _line(v) -> str:
    """A gate-style evidence line: `FAIL  <run_key>  <metric>: value=..., baseline=..., ...`."""
    return f"{v.verdict:4}  {v.run_key}  {v.metric}: {v.evidence()}"


def assert_metric(result: Any, name: str, *, max: float | None = None, min: float | None = None,
                  rel_to_baseline: float | None = None, abs_tol: float = 0.0, direction: str = "lower",
                  baselines: str | Path | None = None) -> float:
    """Assert on one metric of a result (doc or file); returns its value.

    `max` / `min` are absolute limits. `rel_to_baseline=r` compares with the
    stored baseline (`<baselines>/<suite>/<run_key>.json`): the metric may be
    worse (per `direction`: lower or higher is better) by at most
    `max(abs_tol, r * |baseline|)`, the gate's tolerance formula. The failure
    message is the gate's evidence line. Under `--numerics-update-baselines`
    the baseline comparison is skipped.
    """
    __tracebackhide__ = True
    from evalharness.gate import hardware_class, Verdict, baseline_path

    if direction not in ("lower", "higher"):
        raise ValueError(f"assert_metric: direction must be 'lower' or 'higher', got {direction!r}")
    doc = _as_doc(result)
    key = doc.get("run_key", "?")
    metrics = doc.get("metrics") or {}
    if name not in metrics:
        close = difflib.get_close_matches(name, list(metrics), n=3)
        pytest.fail(f"{key}: no metric '{name}' in the result" + (f" (did you mean {close}?)" if close else ""),
                    pytrace=False)
    value = metrics[name]
    v = Verdict(key, name, "FAIL", value=value)
    if doc.get("status") != "ok":
        err = doc.get("error") or {}
        v.message = f"run failed: {err.get('type')}: {err.get('message')}"
        pytest.fail(_line(v), pytrace=False)
    if value is None:
        v.message = "value is NaN/Inf (non-finite outputs)"
        pytest.fail(_line(v), pytrace=False)
    if max is not None and value > max:
        v.threshold, v.message = float(max), f"above the limit max={max}"
        pytest.fail(_line(v), pytrace=False)
    if min is not None and value < min:
        v.threshold, v.message = float(min), f"below the limit min={min}"
        pytest.fail(_line(v), pytrace=False)
    opts = _current()
    if rel_to_baseline is not None and not (opts and opts.update_baselines):
        bdir = Path(baselines) if baselines is not None else (opts.baselines if opts else None)
        if bdir is None:
            raise ValueError("assert_metric(rel_to_baseline=...): pass baselines=DIR (no pytest session active)")
        suite = (doc.get("suite") or {}).get("name", "default")
        bpath = baseline_path(bdir, suite, key, hardware_class(doc))
        if not bpath.exists():
            v.message = f"no baseline at {bpath}; create it with `pytest --numerics-update-baselines`"
            pytest.fail(_line(v), pytrace=False)
        bval = _as_doc(bpath)["metrics"].get(name)
        if bval is None:
            v.message = f"metric absent (or non-finite) in the baseline {bpath}"
            pytest.fail(_line(v), pytrace=False)
        v.baseline, v.delta = bval, value - bval
        v.threshold = builtins.max(float(abs_tol), float(rel_to_baseline) * abs(bval))
        worse = v.delta if direction == "lower" else -v.delta
        if worse > v.threshold:
            v.message = f"regression: worse than baseline beyond tolerance ({direction} is better)"
            pytest.fail(_line(v), pytrace=False)
    return value


def assert_gate_passes(results_dir: Any, *, baselines: str | Path | None = None,
                       gate_cfg: dict[str, Any] | None = None, allow_missing: bool = False) -> list:
    """Gate a results folder (or `numerics_results`) against the baselines; fail with the evidence lines.

    Rules come from the results' suite.json unless `gate_cfg` (a suite's `gate:`
    section) is given. Missing baselines fail unless `allow_missing`; a baseline of another
    run or measured otherwise (other eval settings, checkpoint, corpus) always fails. Under
    `--numerics-update-baselines` the session wrote baselines instead: passes.
    Returns the verdicts.
    """
    __tracebackhide__ = True
    from evalharness.gate import exit_code, gate_results

    opts = _current()
    if opts is not None and opts.update_baselines:
        return []
    bdir = Path(baselines) if baselines is not None else (opts.baselines if opts else None)
    if bdir is None:
        raise ValueError("assert_gate_passes: pass baselines=DIR (no pytest session active)")
    verdicts, missing = gate_results(Path(results_dir), bdir, gate_cfg, allow_missing=allow_missing)
    code = exit_code(verdicts, missing)
    if code != 0:
        bad = [_line(v) for v in verdicts if v.verdict == "FAIL"]
        counts = {k: sum(v.verdict == k for v in verdicts) for k in ("PASS", "WARN", "FAIL")}
        outcome = "FAIL (regression)" if code == 1 else "ERROR (missing or mismatched baselines)"
        head = (f"numerics gate {outcome}: "
                f"{counts['PASS']} PASS, {counts['WARN']} WARN, {counts['FAIL']} FAIL against {bdir}")
        msg = [head] + bad + [f"BASELINE  {m}" for m in missing]
        if missing:
            msg.append("create baselines with `pytest -m numerics --numerics-update-baselines`")
        pytest.fail("\n".join(msg), pytrace=False)
    return verdicts
