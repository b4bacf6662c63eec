"""lm-eval's own tasks, offline: their datasets read from the shared data folder.

* ``datasets.yaml`` (package data): which Hugging Face datasets the data folder stands in for, from which files;
* :mod:`.parsers`: the folder's file formats turned into those datasets' records;
* :mod:`.registry`: the YAML read through ``importlib.resources`` and the datasets built in memory;
* :mod:`.manager`: lm-eval's ``TaskManager`` whose tasks read those datasets (:func:`task_manager`).
"""

from evalharness.taskdata.manager import task_manager
from evalharness.taskdata.registry import LocalDataset, local_dataset, registry

__all__ = ["LocalDataset", "local_dataset", "registry", "task_manager"]
