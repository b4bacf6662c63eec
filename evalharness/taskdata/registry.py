"""The local stand-ins for Hugging Face datasets: ``datasets.yaml`` read and validated, datasets built from the data dir.

``datasets.yaml`` ships inside the package and is found through :mod:`importlib.resources`, so an installed wheel
has it. :func:`local_dataset` answers whether a task's ``(dataset_path, dataset_name)`` is one the data dir stands in
for; :meth:`LocalDataset.load` builds its ``datasets.DatasetDict`` in memory (nothing downloaded, nothing written to
the HF cache), once per process and data dir.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.resources
import re
from pathlib import Path
from typing import Any

import yaml

from evalharness.errors import DataError
from evalharness.taskdata.parsers import PARSERS

RESOURCE = "datasets.yaml"
_PLACEHOLDER = re.compile(r"\{(\w+)\}")
_BUILT: dict[tuple, Any] = {}


@dataclasses.dataclass(frozen=True)
class LocalDataset:
    """One HF dataset config and the data-dir files that stand in for it."""

    path: str  # HF dataset id (a task's dataset_path)
    name: str | None  # its config (a task's dataset_name)
    parser: str
    splits: dict[str, tuple[str, ...]]  # split -> files relative to the data dir
    empty: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        """'path' or 'path (name)', for messages."""
        return self.path if self.name is None else f"{self.path} ({self.name})"

    def files(self, data_dir: str | Path) -> dict[str, list[Path]]:
        """The absolute files of every split; an error naming the first one missing."""
        root = Path(data_dir).expanduser()
        if not root.is_dir():
            raise DataError(f"data dir {root} does not exist (from --data-dir, $EVALHARNESS_DATA_DIR or the tasks "
                            "eval's data_dir)")
        out = {}
        for split, rels in self.splits.items():
            out[split] = [root / rel for rel in rels]
            for p in out[split]:
                if not p.is_file():
                    raise DataError(f"{p} is missing: {self.label} ({split} split) is read from the data dir "
                                    "(see the shared data folder's README)")
        return out

    def load(self, data_dir: str | Path) -> Any:
        """The ``datasets.DatasetDict`` of this dataset from `data_dir` (built once per process and data dir)."""
        import datasets

        files = self.files(data_dir)
        key = (self.path, self.name, tuple((s, tuple((str(p), p.stat().st_mtime_ns) for p in ps))
                                           for s, ps in sorted(files.items())))
        if key not in _BUILT:
            parse = PARSERS[self.parser]
            built = {split: datasets.Dataset.from_list(parse(paths, self.name)) for split, paths in files.items()}
            features = next(iter(built.values())).features
            for split in self.empty:
                built[split] = datasets.Dataset.from_dict({k: [] for k in features}, features=features)
            _BUILT[key] = datasets.DatasetDict(built)
        return _BUILT[key]


@dataclasses.dataclass(frozen=True)
class Registry:
    """``datasets.yaml``: the lm-eval task folders indexed first and the datasets the data dir stands in for."""

    lm_eval_folders: tuple[str, ...]
    datasets: tuple[dict, ...]  # validated raw entries; a templated name matches any config with files

    def lookup(self, path: Any, name: Any) -> LocalDataset | None:
        """The local stand-in for a task's (dataset_path, dataset_name), or None when there is none. A templated
        entry (``name: "{subject}"``) matches any config name; one the data dir lacks fails on load, naming the
        missing file."""
        for raw in self.datasets:
            if raw["path"] != path:
                continue
            pattern = raw["name"]
            if pattern is None or not _PLACEHOLDER.search(pattern):
                if pattern == name:
                    return _entry(raw, {})
            elif isinstance(name, str) and re.fullmatch(r"[\w.-]+", name):
                return _entry(raw, {key: name for key in _PLACEHOLDER.findall(pattern)})
        return None

    def served(self) -> list[str]:
        """Every dataset listed, for messages: 'Rowan/hellaswag', 'allenai/ai2_arc (ARC-Easy)', ..."""
        return [raw["path"] if raw["name"] is None else f"{raw['path']} ({raw['name']})" for raw in self.datasets]


def _entry(raw: dict, values: dict[str, str]) -> LocalDataset:
    """A LocalDataset from a raw entry, placeholders filled in."""
    fill = (lambda s: s.format(**values)) if values else (lambda s: s)
    return LocalDataset(path=raw["path"], name=None if raw["name"] is None else fill(raw["name"]),
                        parser=raw["parser"],
                        splits={split: tuple(fill(f) for f in files) for split, files in raw["splits"].items()},
                        empty=tuple(raw.get("empty") or ()))


def parse_registry(raw: Any, where: str) -> Registry:
    """Validate the YAML's content; errors name `where` and the entry."""
    if not isinstance(raw, dict) or set(raw) != {"lm_eval_folders", "datasets"}:
        raise DataError(f"{where}: expected exactly the keys 'lm_eval_folders' and 'datasets'")
    folders = raw["lm_eval_folders"]
    if not isinstance(folders, list) or not all(isinstance(f, str) and f for f in folders):
        raise DataError(f"{where}: 'lm_eval_folders' must be a list of folder names")
    entries = []
    for i, e in enumerate(raw["datasets"] or []):
        at = f"{where}: datasets[{i}]"
        if not isinstance(e, dict) or not {"path", "name", "parser", "splits"} <= set(e) or \
                set(e) - {"path", "name", "parser", "splits", "empty"}:
            raise DataError(f"{at}: needs path, name, parser, splits (and optionally empty), got {e!r}")
        if e["parser"] not in PARSERS:
            raise DataError(f"{at}: unknown parser '{e['parser']}'; parsers: {sorted(PARSERS)}")
        if not isinstance(e["splits"], dict) or not e["splits"]:
            raise DataError(f"{at}: 'splits' must map split names to files")
        splits = {}
        for split, files in e["splits"].items():
            files = [files] if isinstance(files, str) else files
            if not isinstance(files, list) or not files or not all(isinstance(f, str) for f in files):
                raise DataError(f"{at}: split '{split}' must be a file or a list of files")
            splits[split] = files
        empty = e.get("empty") or []
        if not isinstance(empty, list) or set(empty) & set(splits):
            raise DataError(f"{at}: 'empty' must list splits that 'splits' does not have")
        entries.append({**e, "splits": splits, "empty": empty})
    return Registry(lm_eval_folders=tuple(folders), datasets=tuple(entries))


@functools.lru_cache(maxsize=1)
def registry() -> Registry:
    """The package's ``datasets.yaml``, read once."""
    res = importlib.resources.files("evalharness.taskdata") / RESOURCE
    try:
        text = res.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DataError(f"evalharness/taskdata/{RESOURCE} is missing from the installed package; reinstall "
                        "evalharness") from None
    return parse_registry(yaml.safe_load(text), f"evalharness/taskdata/{RESOURCE}")


def local_dataset(path: Any, name: Any) -> LocalDataset | None:
    """The data dir's stand-in for the HF dataset (path, name), or None."""
    return registry().lookup(path, name)
