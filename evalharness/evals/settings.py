"""The settings of each eval (the suite's `evals.<name>` mappings): one pydantic schema per eval, defaults included.

Integers are positive (``num_fewshot`` may be 0); unknown settings are errors. The evals check what only they
can (task names, backends, variant entries) when they run.
"""

from __future__ import annotations

from typing import Annotated, Any, Union

from pydantic import Field, StrictBool, StrictFloat, StrictInt, StrictStr

from evalharness.schema import Schema

Pos = Annotated[StrictInt, Field(gt=0, description="a positive integer")]
PosNumber = Annotated[Union[StrictInt, StrictFloat], Field(gt=0, allow_inf_nan=False)]
Items = list[Any]
Mapping = dict[str, Any]

# What a value must be, by setting name, where the type alone does not say it.
NEEDS = {
    "limit": "a positive integer or a mapping of task name -> integer",
    "num_fewshot": "an integer >= 0 or a mapping of task name -> integer",
    "tie_margin": "a finite number > 0", "kernel_factor": "a finite number > 0", "kernel_floor": "a finite number > 0",
    "taps": "a list of tap globs", "variants": "a list of serving variants", "tasks": "a list of task names",
    "include_paths": "a list of folders", "parts": "a list of part names", "prompt_lens": "a list of integers",
    "passkey_lens": "a list of integers", "passkey_depths": "a list of depths in [0, 1]",
    "modules": "a list of module globs", "native_options": "a mapping of native backend options",
    "bos": "true or false", "local": "true or false", "layer_local": "true or false",
    "emulated": "a backend name", "native": "a backend name", "high": "a recipe name", "data_dir": "a folder",
}


class EvalSettings(Schema):
    """What every eval takes: `serving`, the names of the suite's serving configs it runs under (default: all).
    An eval whose results cannot differ between two serving configs (e.g. lm-eval tasks scored and decoded at a
    fixed `tasks.batch_size`) runs under one of them instead of computing the same bits twice."""

    serving: Annotated[list[StrictStr], Field(min_length=1)] | None = None


class LayerError(EvalSettings):
    windows: Pos = 2
    seq_len: Pos = 128
    bos: StrictBool = True
    taps: Items | None = None
    local: StrictBool = True
    layer_local: StrictBool = False


class PplKld(EvalSettings):
    seq_len: Pos = 128
    stride: Pos | None = None
    max_windows: Pos | None = 16
    max_tokens: Pos = 200_000
    bos: StrictBool = True
    ref_topk: Pos | None = None


class Invariance(EvalSettings):
    variants: Items | None = None
    windows: Pos = 4
    seq_len: Pos = 64
    reruns: Pos = 2
    prompt_len: Pos = 16
    greedy_tokens: Pos = 8


class Tasks(EvalSettings):
    tasks: Items | None = None
    limit: Union[Pos, Mapping] | None = None
    num_fewshot: Union[Annotated[StrictInt, Field(ge=0)], Mapping] | None = None
    batch_size: Pos | None = None
    include_paths: Items | None = None
    max_gen_toks: Pos | None = None
    data_dir: StrictStr | None = None


class Longctx(EvalSettings):
    parts: Items | None = None
    new_tokens: Pos = 1024
    prompt_lens: Items | None = None
    prompts_per_len: Pos = 2
    entropy_window: Pos = 64
    loop_min_len: Pos = 16
    tie_margin: PosNumber = 0.5
    passkey_lens: Items | None = None
    passkey_depths: Items = [0.0, 0.25, 0.5, 0.75, 1.0]
    passkey_trials: Pos = 4
    kld_docs: Pos = 4
    kld_seq_len: Pos | None = None
    kld_buckets: Pos = 8
    ref_topk: Pos | None = None
    max_tokens: Pos = 200_000
    bos: StrictBool = True


class Threeway(EvalSettings):
    windows: Pos = 4
    seq_len: Pos = 128
    emulated: StrictStr = "cuda-emulated"
    native: StrictStr = "cuda-native"
    kernel_factor: PosNumber = 2.0
    kernel_floor: PosNumber = 1.0e-3
    native_options: Mapping | None = None


class Switching(EvalSettings):
    modules: Items | None = None
    high: StrictStr = "bf16"
    windows: Pos = 4
    seq_len: Pos = 128
    reps: Pos = 3


# eval name -> the schema of its settings (the suite's `evals` keys, in this order)
EVAL_SETTINGS: dict[str, type[Schema]] = {
    "layer_error": LayerError, "ppl_kld": PplKld, "tasks": Tasks, "longctx": Longctx, "invariance": Invariance,
    "threeway": Threeway, "switching": Switching,
}
