"""Data-parallel evaluation: `evalharness run` under `torchrun --nproc-per-node N`.

Detected from torchrun's environment (``WORLD_SIZE`` / ``RANK`` /
``LOCAL_RANK``); the process group is gloo on CPU, NCCL on GPUs (one GPU
per rank, ``LOCAL_RANK``), plus a gloo group for the Python objects
(schedule, result documents) whichever the device.

The unit of work is the RunSpec. Each needs a model-parallel group of
`group_size(spec)` ranks (the largest tp / ep of its serving config and of
its invariance variants; 1 for plain runs). `schedule` places every RunSpec
on a block of that many consecutive ranks, balancing the number of runs per
rank; every rank computes the same schedule and runs its RunSpecs in suite
order, so the collectives of a shared RunSpec meet. A RunSpec is computed
whole on its ranks (same windows, same batches, same seed as a single
process), so its metrics equal the single-process run's: exactly for
deterministic kernels (CPU), per-window samples included.

Rank 0 writes every result file (its own as they finish, the others' when
gathered at the end), `suite.json`, the reference cache and the mlflow
logs; the other ranks write nothing. All ranks return the same outcomes,
so they exit with the same code.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Sequence

import torch
import torch.distributed as dist

from engine.api import ParallelConfig, ParallelError
from evalharness.errors import HarnessError, SuiteError

__all__ = ["DataParallel", "check_degrees", "check_world", "current", "group_size", "init_from_env", "schedule",
           "serving_parallel", "shutdown"]


def serving_parallel(serving: dict[str, Any]) -> ParallelConfig:
    """The tp / ep of a serving config (defaults 1)."""
    return ParallelConfig(tp=serving.get("tp", 1), ep=serving.get("ep", 1))


def _variant_degrees(spec) -> list[ParallelConfig]:
    """tp / ep of the invariance variants of `spec` (unset keys inherit the run's own serving config)."""
    own = serving_parallel(spec.serving)
    variants = (spec.evals.get("invariance") or {}).get("variants") or []
    return [ParallelConfig(tp=v.get("tp", own.tp), ep=v.get("ep", own.ep)) for v in variants if isinstance(v, dict)]


def group_size(spec) -> int:
    """Ranks one RunSpec needs: the largest tp / ep of its serving config and its invariance variants."""
    return max([serving_parallel(spec.serving).size] + [p.size for p in _variant_degrees(spec)])


def check_degrees(serving: dict[str, Any], evals: dict[str, Any], where: str) -> None:
    """Serving and invariance-variant degrees > 1 must agree (one model-parallel group per RunSpec)."""
    try:
        own = serving_parallel(serving)
        sizes = {p.size for p in [own] + [ParallelConfig(tp=v.get("tp", own.tp), ep=v.get("ep", own.ep))
                                          for v in (evals.get("invariance") or {}).get("variants") or []
                                          if isinstance(v, dict)]} - {1}
    except ParallelError as exc:
        raise SuiteError(f"{where}: {exc}") from None
    if len(sizes) > 1:
        raise SuiteError(f"{where}: the serving config and the invariance variants use parallel degrees "
                         f"{sorted(sizes)}; one run is served by one group, so every tp / ep > 1 must be the same")


def check_world(specs: Sequence, world: int) -> None:
    """A clear error when a RunSpec needs more processes than this run has."""
    for spec in specs:
        g = group_size(spec)
        if g > world:
            p = serving_parallel(spec.serving)
            raise SuiteError(f"run '{spec.key}' needs {g} processes (serving '{spec.serving['name']}': tp={p.tp}, "
                             f"ep={p.ep}, or an invariance variant) but this run has {world}: launch it with "
                             f"`torchrun --nproc-per-node {g} -m evalharness.cli run ...` (or more processes)")


def schedule(specs: Sequence, world: int) -> list[tuple[int, ...]]:
    """The ranks of each RunSpec: a block of `group_size` consecutive ranks, fewest runs first.

    Ties go to a block whose ranks last ran the same model (no reload), then to
    the lowest ranks. Deterministic: every rank computes the same answer.
    """
    load = [0] * world
    last_model: list[str | None] = [None] * world
    out = []
    for spec in specs:
        g = group_size(spec)
        blocks = [tuple(range(j * g, (j + 1) * g)) for j in range(world // g)]
        name = spec.model["name"]
        best = min(blocks, key=lambda b: (max(load[r] for r in b), any(last_model[r] != name for r in b), b[0]))
        for r in best:
            load[r] += 1
            last_model[r] = name
        out.append(best)
    return out


@dataclasses.dataclass
class DataParallel:
    """This process's place in a torchrun world, and the groups of the RunSpecs it shares."""

    rank: int
    world: int
    control: Any  # gloo group for object collectives (None = the default group, already gloo)
    groups: dict[tuple[int, ...], Any] = dataclasses.field(default_factory=dict)

    def make_groups(self, placements: Sequence[tuple[int, ...]]) -> None:
        """Create the model-parallel groups of `placements` (collective: every rank, same order)."""
        for ranks in sorted(set(placements)):
            if len(ranks) > 1 and ranks not in self.groups:
                self.groups[ranks] = None if len(ranks) == self.world else dist.new_group(list(ranks))

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank."""
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's `obj`, in rank order, on rank 0 (None elsewhere)."""
        box = [None] * self.world if self.rank == 0 else None
        dist.gather_object(obj, box, dst=0, group=self.control)
        return box


def init_from_env(device: str) -> DataParallel | None:
    """Join the torchrun world described by the environment; None for a single process.

    `device` is ``cpu`` (gloo) or ``cuda`` (NCCL, GPU ``LOCAL_RANK``).
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1 and not dist.is_initialized():
        return None
    if not dist.is_initialized():
        if device == "cuda":
            local, visible = int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()
            if local >= visible:
                raise HarnessError(f"rank with LOCAL_RANK={local} has no GPU: {visible} visible; launch at most "
                                   f"`torchrun --nproc-per-node {visible}` per node for a cuda backend")
            torch.cuda.set_device(local)
        dist.init_process_group(backend="nccl" if device == "cuda" else "gloo")
    return current()


_CONTROL: dict[str, Any] = {}


def current() -> DataParallel | None:
    """The initialised world as a `DataParallel` (None when torch.distributed is not initialised or has 1 rank)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    if "group" not in _CONTROL:  # object collectives need a CPU (gloo) group; created once per process
        _CONTROL["group"] = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
    return DataParallel(rank=dist.get_rank(), world=dist.get_world_size(), control=_CONTROL["group"])


def shutdown() -> None:
    """Leave the torchrun world (end of `evalharness run`)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _CONTROL.clear()
