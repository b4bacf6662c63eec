"""lm-eval's TaskManager with its tasks' datasets read from the data dir.

lm-eval builds every task, group member and tag member from its config through one factory. The factory here
(:class:`LocalDataFactory`, a subclass of lm-eval's) changes one thing: a task whose ``(dataset_path,
dataset_name)`` the data dir stands in for (``datasets.yaml``) gets a ``custom_dataset`` that builds that dataset
from the local files. Everything else of the task (prompts, few-shot split and sampler, filters, metrics, group
aggregation) is lm-eval's own. Tasks with a ``custom_dataset`` of their own, and datasets the data dir does not
stand in for, load as lm-eval loads them (offline: from local files or the local HF cache).

Indexing lm-eval's ~230 task folders takes seconds, so :func:`task_manager` first indexes only the folders of
``datasets.yaml`` (``lm_eval_folders``) plus the user's ``include_paths`` (which override lm-eval's tasks of the
same name), and the whole index only when a name is found in neither.
"""

from __future__ import annotations

import importlib.resources
import logging
from pathlib import Path
from typing import Any

from evalharness.errors import DataError
from evalharness.taskdata.registry import local_dataset, registry

_MANAGERS: dict[tuple, Any] = {}


def _factory_class():
    """LocalDataFactory, defined on first use (lm-eval is an optional dependency)."""
    try:
        from lm_eval.tasks._factory import TaskFactory
    except ImportError as exc:
        raise DataError(f"tasks eval: this lm-eval has no lm_eval.tasks._factory.TaskFactory ({exc}); the harness "
                        "needs lm-eval >= 0.4.13, < 0.5 (pip install 'evalharness[eval]')") from None

    class LocalDataFactory(TaskFactory):
        """lm-eval's task factory; tasks whose dataset the data dir stands in for read it from there."""

        def __init__(self, *, meta: dict[str, Any] | None = None, data_dir: str | None = None):
            """`meta`: lm-eval's task metadata for every task; `data_dir`: the shared data folder (None: not given)."""
            super().__init__(meta=meta)
            self.data_dir = data_dir

        def _load_full_config(self, entry, overrides=None):
            """lm-eval's config of `entry`, with a local ``custom_dataset`` when the data dir stands in for it."""
            cfg = super()._load_full_config(entry, overrides)
            if cfg.get("custom_dataset") is None and isinstance(cfg.get("task"), str):
                local = local_dataset(cfg.get("dataset_path"), cfg.get("dataset_name"))
                if local is not None:
                    cfg["custom_dataset"] = _loader(local, self.data_dir, str(cfg["task"]))
            return cfg

    return LocalDataFactory


def _loader(local, data_dir: str | None, task: str):
    """lm-eval's ``custom_dataset`` for one task: the local dataset (it is called with the task's metadata and
    dataset_kwargs, which the files do not need)."""

    def load(**_task_kwargs):
        """The DatasetDict of `local` from the data dir."""
        if data_dir is None:
            raise DataError(f"task '{task}' reads {local.label} from the shared data folder: run with --data-dir DIR "
                            "(or set $EVALHARNESS_DATA_DIR, or the tasks eval's data_dir)")
        return local.load(data_dir)

    return load


def lm_eval_task_folders() -> list[str]:
    """lm-eval's bundled task folders of ``datasets.yaml`` that this installation has."""
    root = importlib.resources.files("lm_eval") / "tasks"
    return [str(Path(str(root / f))) for f in registry().lm_eval_folders if (root / f).is_dir()]


def _build(paths: list[str], defaults: bool, data_dir: str | None):
    """A TaskManager over `paths` (and lm-eval's whole index when `defaults`) with the local-data factory."""
    from lm_eval.tasks import TaskManager

    meta = {"data_dir": data_dir} if data_dir else {}
    logger = logging.getLogger("lm_eval")
    old = logger.level
    logger.setLevel(logging.ERROR)
    try:
        tm = TaskManager(include_path=paths or None, include_defaults=defaults, metadata=meta)
    finally:
        logger.setLevel(old)
    if not hasattr(tm, "_factory"):
        raise DataError("tasks eval: this lm-eval's TaskManager has no task factory to read local data through; "
                        "the harness needs lm-eval >= 0.4.13, < 0.5")
    tm._factory = _factory_class()(meta=meta, data_dir=data_dir)
    return tm


def task_manager(names: list[str], include_paths: list[str], data_dir: str | None):
    """A (cached) TaskManager that knows every name in `names`: lm-eval's folders of ``datasets.yaml`` and the user's
    `include_paths` first, lm-eval's whole index only when a name is missing there."""
    user = []
    for p in include_paths:
        if not Path(p).expanduser().is_dir():
            raise DataError(f"tasks eval: include_paths entry '{p}' is not a folder")
        user.append(str(Path(p).expanduser().resolve()))
    missing: list[str] = []
    for defaults in (False, True):
        paths = user if defaults else lm_eval_task_folders() + user
        key = (tuple(paths), defaults, data_dir)
        if key not in _MANAGERS:
            _MANAGERS[key] = _build(paths, defaults, data_dir)
        tm = _MANAGERS[key]
        missing = [n for n in names if n not in tm.all_tasks]
        if not missing:
            return tm
    raise DataError(f"tasks eval: unknown task(s) {missing}: not an lm-eval task, group or tag, nor in include_paths "
                    f"{include_paths or []}")
