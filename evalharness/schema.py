"""Pydantic schemas of the YAML the harness reads (suite, eval settings, gate rules) and their error messages.

A refused value becomes one message in the project's words: the key path as the user wrote it
(``serving[1].attn_block``), what the value must be, the value given and, where there is one, what to do::

    suites/x.yaml: serving[1].attn_block must be one of 64, 128 or 256, got 96
    suites/x.yaml: evals.ppl_kld: unknown key(s) ['max_window']; allowed: ['seq_len', 'stride', ...]
    suites/x.yaml: required key 'name' is missing (the suite's name)

"What it must be" comes from a table by key (`needs`), else from the field's `description`; unknown keys list
the keys the mapping at that path allows (read from the schema, so the list cannot drift from it).
"""

from __future__ import annotations

import types
import typing
from typing import Any, Union

from pydantic import BaseModel, ConfigDict, ValidationError

CUSTOM = "schema"  # the error type of checks written as PydanticCustomError(CUSTOM, "message")


class Schema(BaseModel):
    """Unknown keys are errors; values are taken as written (no coercion of strings to numbers)."""

    model_config = ConfigDict(extra="forbid", strict=True)


def _is_union_member(part: Any) -> bool:
    """Pydantic's name of a member of a union in an error location (not a key the user wrote)."""
    if not isinstance(part, str):
        return False
    tags = ("constrained-", "Strict", "literal[", "list[", "dict[", "function-")
    return (part in ("int", "float", "str", "bool", "list", "dict") or part.startswith(tags)
            or part[:1].isupper())


def _keys(loc: tuple) -> list:
    """The location without pydantic's union member names."""
    return [p for p in loc if not _is_union_member(p)]


def key_path(root: str, loc: tuple) -> str:
    """An error location as the user's key path: ('rules', 1, 'abs_tol') under 'gate' -> 'gate.rules[1].abs_tol'."""
    out = root
    for part in _keys(loc):
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def value_at(raw: Any, loc: tuple) -> Any:
    """The value the user wrote at `loc`."""
    for part in _keys(loc):
        if isinstance(raw, dict) and part in raw:
            raw = raw[part]
        elif isinstance(raw, list) and isinstance(part, int) and part < len(raw):
            raw = raw[part]
        else:
            return None
    return raw


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The schema classes inside a field's annotation (through Optional, list, dict, Union, Annotated)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    out: list[type[BaseModel]] = []
    if typing.get_origin(annotation) in (Union, types.UnionType, list, dict, tuple, typing.Annotated) or \
            typing.get_args(annotation):
        for arg in typing.get_args(annotation):
            out.extend(_models_in(arg))
    return out


def model_at(model: type[BaseModel], loc: tuple) -> type[BaseModel] | None:
    """The schema class of the mapping at `loc` (None when the path leaves the schema)."""
    for part in _keys(loc):
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part)
        found = _models_in(field.annotation) if field is not None else []
        if not found:
            return None
        model = found[0]
    return model


def _need(model: type[BaseModel], loc: tuple, needs: dict[str, str]) -> str | None:
    """What the value at `loc` must be: `needs[key]` of its last key, else that field's description."""
    ks = _keys(loc)
    idx = max((i for i, p in enumerate(ks) if isinstance(p, str)), default=None)
    if idx is None:
        return None
    if ks[idx] in needs:
        return needs[ks[idx]]
    parent = model_at(model, tuple(ks[:idx]))
    field = parent.model_fields.get(ks[idx]) if parent is not None else None
    return field.description if field is not None else None


def _mismatch(err: dict) -> bool:
    """An error that only says the value is not of this member's type (`str` where a list was allowed, ...)."""
    return err["type"].endswith("_type") or (err["type"] == "literal_error" and isinstance(err["input"], (list, dict)))


def _one_member(errors: list[dict]) -> list[dict]:
    """Errors of a union of several types (`backend: NAME | [NAME, ...]`): when a member of the type the user
    wrote has errors, the other members' "not of my type" errors are dropped."""
    def group(err: dict) -> tuple:
        loc = tuple(err["loc"])
        cut = next((i for i, p in enumerate(loc) if _is_union_member(p)), len(loc))
        return loc[:cut]

    real = {group(e) for e in errors if not _mismatch(e)}
    return [e for e in errors if not (_mismatch(e) and group(e) in real)]


def messages(exc: ValidationError, raw: Any, model: type[BaseModel], root: str = "",
             needs: dict[str, str] | None = None, hints: dict[str, str] | None = None) -> list[str]:
    """Each refused key of `raw` (validated against `model`) as one message: the key path under `root`, what it
    must be, the value given, and `hints[key]` (what to do) where there is one. Unknown keys of one mapping are
    one message listing the keys it allows."""
    needs, hints = needs or {}, hints or {}
    out: dict[str, None] = {}
    unknown: dict[tuple, list[str]] = {}
    for err in _one_member(exc.errors()):
        loc = tuple(err["loc"])
        keys = [p for p in _keys(loc) if isinstance(p, str)]
        hint = f" ({hints[keys[-1]]})" if keys and keys[-1] in hints else ""
        if err["type"] == "extra_forbidden":
            unknown.setdefault(tuple(_keys(loc)[:-1]), []).append(str(loc[-1]))
            continue
        at = key_path(root, loc)
        if err["type"] == CUSTOM:
            out[f"{at}: {err['msg']}" if at else err["msg"]] = None
        elif err["type"] == "missing":
            parent = key_path(root, loc[:-1])
            need = _need(model, loc, needs)
            what = f" ({need})" if need else ""
            out[f"{parent + ': ' if parent else ''}required key '{loc[-1]}' is missing{what}{hint}"] = None
        elif err["type"] in ("model_type", "model_attributes_type", "dict_type") and model_at(model, loc):
            fields = list(model_at(model, loc).model_fields)
            out[f"{at} must be a mapping with keys {fields}, got {err['input']!r}{hint}"] = None
        elif err["type"] == "literal_error":
            out[f"{at} must be one of {err['ctx']['expected']}, got {err['input']!r}{hint}"] = None
        else:
            need = _need(model, loc, needs) or err["msg"]
            out[f"{at} must be {need}, got {value_at(raw, loc)!r}{hint}"] = None
    for where, names in unknown.items():
        allowed = model_at(model, where)
        at = key_path(root, where)
        listed = f"; allowed: {list(allowed.model_fields)}" if allowed is not None else ""
        out[f"{at + ': ' if at else ''}unknown key(s) {names}{listed}"] = None
    return list(out)
