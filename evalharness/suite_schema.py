"""The suite file's schema (see `evalharness.suite` for an example): keys, types, allowed values and defaults.

`check_suite(raw, where)` validates a parsed suite (after `--set`, before `${data_dir}` expansion) and raises a
SuiteError whose lines each name the file, the key path, what the value must be, the value and what to do.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import Field, StrictBool, StrictInt, StrictStr, ValidationError, create_model, model_validator
from pydantic_core import PydanticCustomError

from engine.api import BACKENDS
from engine.serving import KV_BLOCK_SIZES, ServingConfig
from evalharness.errors import SuiteError
from evalharness.evals.settings import EVAL_SETTINGS
from evalharness.evals.settings import NEEDS as EVAL_NEEDS
from evalharness.schema import CUSTOM, Schema, messages

ATTN_BLOCKS = (64, 128, 256)
REFERENCE_DEVICES = ("auto", "cpu", "cuda")  # auto: the engine's device (docs/guide/models-and-data.md, "Memory")
EXECUTIONS = ("auto", "resident", "streamed")  # evalharness.memory_plan
SOURCES = ("a model source: an HF model folder, an HF hub id (org/name), llama2c:FILE, builtin:NAME or "
           "outliers:<HF folder or hub id>")

Pos = Annotated[StrictInt, Field(gt=0)]
Name = Union[StrictStr, StrictInt]
Backend = Literal[BACKENDS]  # type: ignore[valid-type]


class ModelEntry(Schema):
    """One entry of `models`."""

    name: Name | None = Field(None, description="a name (text)")
    path: StrictStr = Field(description=SOURCES)
    tokenizer: StrictStr | None = Field(None, description="a tokenizer: llama2c:FILE, bytes, an HF folder or file")
    corpus: StrictStr | None = Field(None, description="a corpus: a text file, a token JSON, hf:NAME:SPLIT or "
                                                        "builtin:NAME")


# A serving entry's generation knobs are the engine's `engine.serving.ServingConfig` fields (their one definition: a
# field added there is a suite key here), with the harness's defaults where they differ (64-token pages, CUDA graphs
# on the GPU); the dataclass's `max_batch` is the entry's `batch_size`, and `max_tokens` is sized to each call.
SERVING_DEFAULTS = {"batch_size": 1, "kv_block_size": 64, "cuda_graphs": True}
_ENTRY_NAMES = {"max_batch": "batch_size"}
_PER_CALL = ("max_tokens",)
_KNOB_TYPES = {"bool": StrictBool, "int": Pos, "Optional[int]": Optional[Pos]}


def _serving_knobs() -> dict[str, tuple[Any, Any]]:
    """(type, default) of each ServingConfig field a suite sets, under its suite name."""
    out = {}
    for f in dataclasses.fields(ServingConfig):
        if f.name in _PER_CALL:
            continue
        name = _ENTRY_NAMES.get(f.name, f.name)
        typ = Literal[KV_BLOCK_SIZES] if f.name == "kv_block_size" else _KNOB_TYPES[str(f.type)]
        out[name] = (typ, SERVING_DEFAULTS.get(name, f.default))
    return out


_KNOBS = _serving_knobs()
# ServingConfig's fields a serving entry sets (under their suite names), `runner.serving_config` hands them back
RUNTIME_KNOBS = tuple(k for k in _KNOBS if k != "batch_size")

# One entry of `serving`; every knob but `name` and `batch_size` is recorded only when not its default. The run's
# own knobs: its name, the native kernels' tilings (attn_block, small_m) and the parallel degrees (tp, ep).
ServingEntry = create_model(
    "ServingEntry", __base__=Schema,
    name=(Name | None, Field(None, description="a name (text)")),
    batch_size=_KNOBS["batch_size"], prefill_chunk=_KNOBS["prefill_chunk"],
    attn_block=(Literal[ATTN_BLOCKS], 64),  # type: ignore[valid-type]
    small_m=(Pos | None, 64), tp=(Pos, 1), ep=(Pos, 1),
    **{k: v for k, v in _KNOBS.items() if k not in ("batch_size", "prefill_chunk")})


Evals = create_model("Evals", __base__=Schema,
                     **{name: (schema | None, None) for name, schema in EVAL_SETTINGS.items()})


class SuiteFile(Schema):
    """The top level of a suite file."""

    name: Name = Field(description="the suite's name")
    description: Any = None
    backend: Union[Backend, Annotated[list[Backend], Field(min_length=1)]] = "cpu-emulated"
    reference_device: Literal[REFERENCE_DEVICES] = "auto"  # type: ignore[valid-type]
    execution: Literal[EXECUTIONS] = "auto"  # type: ignore[valid-type]
    seed: StrictInt = 0
    data_dir: StrictStr | None = None
    corpus: StrictStr | None = None
    models: Annotated[list[ModelEntry], Field(min_length=1)]
    recipes: Annotated[list[StrictStr], Field(min_length=1)]
    serving: list[ServingEntry] | None = None
    evals: Evals  # type: ignore[valid-type]
    gate: dict[str, Any] | None = None  # evalharness.gate_rules validates it

    @model_validator(mode="after")
    def _across_keys(self) -> "SuiteFile":
        backends = self.backend if isinstance(self.backend, list) else [self.backend]
        if len(set(backends)) != len(backends):
            raise PydanticCustomError(CUSTOM, "'backend' must be one backend or a list of distinct backends, "
                                      "got {b}", {"b": str(backends)})
        if len({b.split("-")[0] for b in backends}) > 1:
            raise PydanticCustomError(CUSTOM, "backends {b} mix devices; one suite runs on cpu or on cuda, not both",
                                      {"b": str(backends)})
        if not self.evals.model_fields_set:
            raise PydanticCustomError(CUSTOM, "'evals' must map eval names {names} to their settings (none given)",
                                      {"names": str(list(EVAL_SETTINGS))})
        return self


NEEDS = {
    **EVAL_NEEDS,
    "name": "a name (text)", "seed": "an integer", "data_dir": "a folder", "corpus": "a corpus path or builtin:NAME",
    "models": "a non-empty list of {name, path, ...} entries",
    "recipes": "a non-empty list of recipe names or YAML paths",
    "serving": "a list of serving configs", "gate": "a mapping (see docs/guide/gate.md)",
    "batch_size": "a positive integer", "prefill_chunk": "a positive integer or null (the whole window)",
    "small_m": "a positive integer", "tp": "a positive integer", "ep": "a positive integer",
    "cuda_graphs": "true or false", "prefix_cache": "true or false",
    "fp8_paged_max_tq": "a positive integer or null (no bound)", "backend": f"one backend of {list(BACKENDS)} or a list of them",
    "evals": f"a mapping of eval names {list(EVAL_SETTINGS)} to their settings",
}
HINTS = {
    "reference_device": "cpu runs the FP32 reference on the host when it does not fit on the GPU next to the engine",
    "execution": "streamed reads the weights one layer at a time: docs/guide/big-models.md",
    "tp": "tensor parallel degree; leave it out for 1", "ep": "expert parallel degree; leave it out for 1",
    "attn_block": "the native attention kernel's key block", "kv_block_size": "tokens per KV page",
}


def check_suite(raw: dict[str, Any], where: str) -> SuiteFile:
    """The suite validated against `SuiteFile`; a SuiteError listing every refused key (one per line)."""
    try:
        return SuiteFile.model_validate(raw)
    except ValidationError as exc:
        raise SuiteError("\n".join(f"{where}: {m}" for m in messages(exc, raw, SuiteFile, "", NEEDS, HINTS))) from None
