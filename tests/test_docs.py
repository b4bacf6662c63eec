"""The README and docs/ as a user meets them: every command block runs as written, every relative link resolves,
the README stays short and history-free, and CI runs the README's test commands.

Conventions of the pages (docs/design/testing.md describes them for writers):
* a ```bash block is a command block: its lines run in order, in a scratch copy of the repository (with
  `../shared/data` resolving as it does beside the checkout), and each must exit 0;
* `# needs: gpu`, `# needs: 2-gpus` or `# needs: data` as a block's first line skips it where that is missing;
* a line ending in `# serves: http://127.0.0.1:PORT` starts a server: it runs in the background until the page is
  done, and the next line runs once the URL answers;
* `pip install` steps are not run (the test environment is the installed package), nor are the README's test commands
  (`.ci/run` runs those itself: `test_ci_runs_the_readmes_test_commands`);
* the smoke suite runs small: `evalharness run suites/smoke.yaml` (and `ci/gate.sh`, through GATE_ARGS) get the
  built-in tiny-llama as their only model, at the suite's settings, so the committed baselines still apply;
* a ```yaml / ```toml / ```python block whose first line is `# file: PATH` is written to PATH before the page's later
  command blocks run; a page that writes its own `pyproject.toml` is a new project: it runs in an empty folder.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
HISTORY = re.compile(r"sessions? [0-9]+", re.IGNORECASE)  # the issue's `git grep -i -E "session[s]? [0-9]+"`
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
PIP = re.compile(r"^\s*(python3? -m )?pip3? install\b")
SERVES = re.compile(r"\s+#\s*serves:\s*(\S+)\s*$")
# What makes the smoke suite small in the docs test: its one built-in model (the suite's settings are kept).
SMALL_SMOKE = 'models=[{"name":"tiny-llama","path":"builtin:tiny-llama","corpus":"builtin:tiny-llama"}]'  # no spaces
SMOKE_RUN = re.compile(r"(evalharness run suites/smoke\.yaml)(?=\s|$)")


def pages() -> list[Path]:
    """README.md and every markdown page under docs/."""
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def tracked_files() -> list[str]:
    """The files a clean clone would have (tracked, plus new files not ignored: what the next commit holds)."""
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True, text=True,
                         check=True).stdout
    return [f for f in out.splitlines() if (REPO / f).is_file()]


@dataclass
class Block:
    lang: str
    lines: list[str]
    line_no: int  # 1-based line of the opening fence

    @property
    def first(self) -> str:
        return self.lines[0].strip() if self.lines else ""


def blocks(page: Path) -> list[Block]:
    """The fenced code blocks of a page, in order."""
    out, cur = [], None
    for i, line in enumerate(page.read_text().splitlines(), 1):
        fence = re.match(r"^\s*```(\S*)\s*$", line)
        if cur is None and fence:
            cur = Block(fence.group(1).lower(), [], i)
        elif cur is not None and re.match(r"^\s*```\s*$", line):
            out.append(cur)
            cur = None
        elif cur is not None:
            cur.lines.append(line)
    assert cur is None, f"{page}: unclosed code block opened at line {cur.line_no}"
    return out


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors of a page: lower case, punctuation other than '-' and '_' dropped, spaces to '-'."""
    seen: dict[str, int] = {}
    out = set()
    in_code = False
    for line in page.read_text().splitlines():
        if line.lstrip().startswith("```"):
            in_code = not in_code
        m = None if in_code else re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower().replace("`", "")).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_readme_is_short():
    n = len((REPO / "README.md").read_text().splitlines())
    assert n <= 400, f"README.md has {n} lines; the limit is 400: move detail into docs/"


def test_repository_speaks_of_no_sessions():
    """Docs, code, tests and results state what is true now; history stays in git."""
    hits = []
    for f in tracked_files():
        try:
            text = (REPO / f).read_text()
        except UnicodeDecodeError:
            continue
        hits += [f"{f}:{i}: {line.strip()[:120]}" for i, line in enumerate(text.splitlines(), 1)
                 if HISTORY.search(line)]
    assert not hits, "development history in the repository:\n" + "\n".join(hits[:40])


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(page):
    """Every relative link of a page names an existing file, and its #anchor a heading of that page."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    bad = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target}: no such file {dest.relative_to(REPO) if dest.is_relative_to(REPO) else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no heading #{anchor} in {dest.relative_to(REPO)}")
    assert not bad, f"{page.relative_to(REPO)}:\n" + "\n".join(bad)


def readme_test_commands() -> list[str]:
    """The command lines of the README's "Tests" section."""
    text = (REPO / "README.md").read_text()
    m = re.search(r"^## Tests\b.*?```bash\n(.*?)```", text, flags=re.S | re.M)
    assert m, "README.md has no '## Tests' section with a bash block"
    return [line.split(" #")[0].rstrip() for line in m.group(1).splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def test_ci_runs_the_readmes_test_commands():
    """`.ci/run` runs each of the README's test command lines verbatim, and nothing the README does not show."""
    ci = (REPO / ".ci" / "run").read_text()
    commands = readme_test_commands()
    assert any(c.startswith("python3 -m pytest") for c in commands), commands
    missing = [c for c in commands if c not in ci]
    assert not missing, f".ci/run does not run these README test commands verbatim: {missing}"


# --- running the command blocks -------------------------------------------------------------------------------------


def _needs(block: Block) -> str | None:
    """Why a block cannot run here (its `# needs:` line), or None."""
    m = re.match(r"^#\s*needs:\s*(.+)$", block.first)
    if not m:
        return None
    for need in (n.strip() for n in m.group(1).split(",")):
        if need == "gpu" and not torch.cuda.is_available():
            return "needs a CUDA GPU"
        if need == "2-gpus" and torch.cuda.device_count() < 2:
            return "needs 2 CUDA GPUs"
        if need == "data" and not (REPO.parent / "shared" / "data").is_dir():
            return "needs the shared data dir at ../shared/data"
        if need not in ("gpu", "2-gpus", "data"):
            raise AssertionError(f"unknown `# needs: {need}` (gpu, 2-gpus, data)")
    return None


def _commands(block: Block, ci_commands: set[str]) -> list[tuple[str, str | None]]:
    """A bash block's commands as (command, URL it serves or None): continuation lines joined, comments, pip-install
    steps and the README's test commands (`ci_commands`) dropped, smoke runs made small."""
    joined, cur = [], ""
    for line in block.lines:
        cur += line.rstrip()
        if cur.endswith("\\"):
            cur = cur[:-1] + " "
            continue
        joined.append(cur)
        cur = ""
    out = []
    for line in joined:
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        served = SERVES.search(line)
        body = SERVES.sub("", line) if served else line
        parts = [p for p in body.split(" && ")
                 if not PIP.match(p) and p.split(" #")[0].strip() not in ci_commands]
        parts = [SMOKE_RUN.sub(lambda m: f"{m.group(1)} --set '{SMALL_SMOKE}'", p) for p in parts]
        if parts:
            out.append((" && ".join(parts), served.group(1) if served else None))
    return out


@dataclass
class Page:
    """A page's run: its scratch folder and the servers it started."""
    root: Path
    env: dict
    servers: list = field(default_factory=list)

    def run(self, where: str, command: str, url: str | None = None) -> None:
        if url:
            self.serve(where, command, url)
            return
        t0 = time.time()
        proc = subprocess.run(["bash", "-eo", "pipefail", "-c", command], cwd=self.root, env=self.env,
                              capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, (f"{where}: `{command}` exited {proc.returncode} after {time.time() - t0:.0f} s\n"
                                      f"--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}")

    def serve(self, where: str, command: str, url: str) -> None:
        log = open(self.root / f"server-{len(self.servers)}.log", "w")
        proc = subprocess.Popen(["bash", "-c", f"exec {command}"], cwd=self.root, env=self.env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        self.servers.append(proc)
        deadline = time.time() + 90
        while time.time() < deadline:
            assert proc.poll() is None, f"{where}: server `{command}` exited {proc.returncode}"
            try:
                urllib.request.urlopen(url, timeout=2)
                return
            except OSError:
                time.sleep(0.5)
        raise AssertionError(f"{where}: `{command}` did not answer at {url} within 90 s")

    def stop(self) -> None:
        for proc in self.servers:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)


def _scratch(tmp_path: Path, new_project: bool) -> Path:
    """A copy of the clean clone (or an empty project folder) with ../shared beside it as beside the checkout."""
    root = tmp_path / "work" / "project"
    root.mkdir(parents=True)
    shared = REPO.parent / "shared"
    if shared.is_dir():
        (tmp_path / "work" / "shared").symlink_to(shared)
    if not new_project:
        for f in tracked_files():
            dest = root / f
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / f, dest)
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    subprocess.run(["git", "-c", "user.name=docs", "-c", "user.email=docs@localhost", "add", "-A"], cwd=root, check=True)
    return root


def _runnable_pages() -> list[Path]:
    return [p for p in pages() if any(b.lang == "bash" for b in blocks(p))]


@pytest.mark.slow
@pytest.mark.parametrize("page", _runnable_pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_command_blocks_run_as_written(page, tmp_path):
    """Every command block of the page runs as written, in order, and exits 0 (skipped blocks say why)."""
    page_blocks = blocks(page)
    new_project = any(b.first.replace(" ", "") == "#file:pyproject.toml" for b in page_blocks)
    root = _scratch(tmp_path, new_project)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "GIT_AUTHOR_NAME": "docs", "GIT_AUTHOR_EMAIL": "docs@localhost", "GIT_COMMITTER_NAME": "docs",
           "GIT_COMMITTER_EMAIL": "docs@localhost", "GATE_ARGS": f"--set {SMALL_SMOKE}"}
    env.pop("EVALHARNESS_DATA_DIR", None)  # the pages say where the data is
    run = Page(root, env)
    ci_commands = set(readme_test_commands())
    skipped, ran = [], 0
    try:
        for b in page_blocks:
            where = f"{page.relative_to(REPO)}:{b.line_no}"
            file = re.match(r"^#\s*file:\s*(\S+)$", b.first)
            if file and b.lang in ("yaml", "yml", "toml", "python", "py", "text", "ini"):
                dest = root / file.group(1)
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_text("\n".join(b.lines[1:]) + "\n")
                continue
            if b.lang != "bash":
                continue
            why = _needs(b)
            if why:
                skipped.append(f"{where} ({why})")
                continue
            for command, url in _commands(b, ci_commands):
                run.run(where, command, url)
                ran += 1
    finally:
        run.stop()
    if skipped and not ran:
        pytest.skip("; ".join(skipped))
