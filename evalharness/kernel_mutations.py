"""Source mutations: an engine function or Triton kernel recompiled from its own source with one snippet replaced.

A catalog entry (`suites/selftest/mutations.yaml`) with `mutate:` lists edits ``{find, replace[, target]}``; each
edit applies to the function `target` (``module:attr`` or ``module:Class.method``; default: the entry's target).
`mutated(entry_id, target, edits)` takes each function's current source, checks that every `find` occurs in it
exactly once (else a SuiteError naming the entry, the function and the snippet: the kernel changed and the catalog
must follow), and swaps the edited source in *in place*, for the duration of the block:

* a ``@triton.jit`` (or Gluon) function: its source is replaced through Triton's own hook
  (`JITCallable._unsafe_update_src`), then the hash and the compiled-kernel caches of every JIT function of the
  loaded ``engine.*`` modules are dropped, so that each kernel that calls it, directly or through other helpers,
  compiles again with the mutated helper (Triton keys its in-memory cache on the arguments only, and a caller's
  hash on its callees' hashes, memoized);
* the same function under the Triton interpreter (``TRITON_INTERPRET=1``): its Python function and its AST
  rewriter are replaced (the interpreter resolves callees by name at call time, so every caller sees it);
* a plain Python function (a launcher, a method): its ``__code__`` is replaced, so every reference to it runs the
  mutated code.

The mutated source is registered in `linecache` under a name that says which entry made it, so tracebacks and
`inspect` show it. On exit (also on an error) the original source / code is put back and the caches are dropped
again: the next call compiles (or loads from Triton's disk cache) the original kernel. No private copy of a kernel
is kept anywhere: the edits are the catalog's data.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import importlib
import inspect
import linecache
import sys
import textwrap
from typing import Any, Iterator

from evalharness.errors import SuiteError


@dataclasses.dataclass(frozen=True)
class Edit:
    """Replace the one occurrence of `find` with `replace` in the source of `target` (None: the entry's target)."""

    find: str
    replace: str
    target: str | None = None


def parse_edits(raw: Any, where: str) -> tuple[Edit, ...]:
    """The `mutate` list of a catalog entry as Edits; errors name `where` and the key."""
    if not isinstance(raw, list) or not raw:
        raise SuiteError(f"{where}: 'mutate' must be a non-empty list of {{find, replace[, target]}} mappings")
    out = []
    for j, e in enumerate(raw):
        w = f"{where}.mutate[{j}]"
        if not isinstance(e, dict) or not set(e) <= {"find", "replace", "target"}:
            raise SuiteError(f"{w} must be a mapping with keys find, replace and an optional target")
        for key in ("find", "replace"):
            if not isinstance(e.get(key), str) or (key == "find" and not e[key]):
                raise SuiteError(f"{w}: '{key}' is required (a string{', not empty' if key == 'find' else ''})")
        if e.get("target") is not None and (not isinstance(e["target"], str) or ":" not in e["target"]):
            raise SuiteError(f"{w}: target must be 'module:attr[.attr]', got {e['target']!r}")
        out.append(Edit(e["find"], e["replace"], e.get("target")))
    return tuple(out)


def resolve_function(target: str) -> Any:
    """The object named by `module:attr[.attr]` (a function, a Triton JIT function, a method)."""
    mod_name, _, path = target.partition(":")
    try:
        obj: Any = importlib.import_module(mod_name)
    except ImportError as exc:
        raise SuiteError(f"mutation target {target!r}: cannot import {mod_name!r} ({exc})") from None
    for p in path.split("."):
        if not hasattr(obj, p):
            raise SuiteError(f"mutation target {target!r}: {obj!r} has no attribute {p!r}")
        obj = getattr(obj, p)
    return obj


def _kind(obj: Any) -> str:
    """'jit' (a compiled Triton JIT function), 'interpreted' (one under the interpreter) or 'python'."""
    try:
        from triton.runtime.jit import JITCallable
    except ImportError:
        JITCallable = ()  # noqa: N806  (no Triton: only plain functions can be targets)
    if JITCallable and isinstance(obj, JITCallable):
        return "jit"
    if type(obj).__name__ == "InterpretedFunction" and hasattr(obj, "rewriter"):
        return "interpreted"
    if inspect.isfunction(obj):
        return "python"
    raise SuiteError(f"mutation target {obj!r}: not a function or a Triton JIT function")


def function_source(target: str) -> str:
    """The current source of `target` from its `def` line on (dedented; decorators left out)."""
    obj = resolve_function(target)
    kind = _kind(obj)
    if kind == "jit":
        return obj.src
    fn = obj.fn if kind == "interpreted" else obj
    src = textwrap.dedent(inspect.getsource(fn))
    tree = ast.parse(src)
    node = tree.body[0]
    first = node.lineno - 1  # the def line (decorators, if any, come before it)
    return "\n".join(src.splitlines()[first:]) + "\n"


def apply_edits(entry_id: str, target: str, src: str, edits: list[Edit]) -> str:
    """`src` with each edit applied; each `find` must occur exactly once."""
    for e in edits:
        n = src.count(e.find)
        if n != 1:
            raise SuiteError(f"mutation {entry_id}: {target}: the snippet {e.find!r} occurs {n} times in its source "
                             "(it must occur exactly once): the kernel changed; update the entry's find / replace in "
                             "suites/selftest/mutations.yaml")
        src = src.replace(e.find, e.replace)
    try:
        ast.parse(src)
    except SyntaxError as exc:
        raise SuiteError(f"mutation {entry_id}: {target}: the mutated source does not parse ({exc.msg}, line "
                         f"{exc.lineno}): fix the entry's replace in suites/selftest/mutations.yaml") from None
    return src


def _compile_function(entry_id: str, target: str, src: str, original: Any) -> Any:
    """A new Python function from the mutated `src` (a single `def`), with `original`'s globals; its source is
    registered in linecache so that inspect (and Triton's interpreter) can read it."""
    filename = f"<mutation {entry_id}: {target}>"
    linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
    namespace: dict[str, Any] = {}
    exec(compile(src, filename, "exec"), original.__globals__, namespace)  # noqa: S102 (the catalog's own edit)
    (fn,) = namespace.values()
    fn.__qualname__ = original.__qualname__
    fn.__module__ = original.__module__
    return fn


def drop_jit_caches() -> int:
    """Forget the memoized hashes and compiled kernels of every Triton JIT function of the loaded engine modules (the
    next call hashes and compiles, or loads from the disk cache, again); returns how many were dropped."""
    try:
        from triton.runtime.jit import JITCallable, JITFunction
    except ImportError:
        return 0
    seen: set[int] = set()
    for name, mod in list(sys.modules.items()):
        if not (name == "engine" or name.startswith("engine.")) or mod is None:
            continue
        for obj in list(vars(mod).values()):
            if isinstance(obj, JITCallable) and id(obj) not in seen:
                seen.add(id(obj))
                obj.hash = None
                # as a fresh process has them: a caller merges its callees' globals before it hashes them, so a hash
                # computed with the callees' globals already known would differ from the first one (and miss the
                # original kernel's disk cache after a restore)
                obj.used_global_vals = {}
                if isinstance(obj, JITFunction):
                    obj.device_caches.clear()
    return len(seen)


class _Swap:
    """One function's mutated source swapped in and out, by its kind (module docstring)."""

    def __init__(self, entry_id: str, target: str, edits: list[Edit]):
        self.target, self.obj = target, resolve_function(target)
        self.kind = _kind(self.obj)
        if self.kind == "python":  # a decorated function (functools.wraps): the code of the function it wraps
            self.obj = inspect.unwrap(self.obj)
        self.src = apply_edits(entry_id, target, function_source(target), edits)
        if self.kind == "jit":
            self.saved = self.obj.src
        elif self.kind == "interpreted":
            self.saved = (self.obj.fn, self.obj.rewriter)
            self.new_fn = _compile_function(entry_id, target, self.src, self.obj.fn)
        else:
            if self.obj.__code__.co_freevars:
                raise SuiteError(f"mutation {entry_id}: {target} is a closure; only module-level functions and "
                                 "methods can be mutated")
            self.saved = self.obj.__code__
            self.new_fn = _compile_function(entry_id, target, self.src, self.obj)

    def plant(self) -> None:
        if self.kind == "jit":
            self.obj._unsafe_update_src(self.src)
        elif self.kind == "interpreted":
            from triton.runtime.interpreter import FunctionRewriter

            self.obj.fn, self.obj.rewriter = self.new_fn, FunctionRewriter(self.new_fn, **self.obj.kwargs)
        else:
            self.obj.__code__ = self.new_fn.__code__

    def restore(self) -> None:
        if self.kind == "jit":
            self.obj._unsafe_update_src(self.saved)
        elif self.kind == "interpreted":
            self.obj.fn, self.obj.rewriter = self.saved
        else:
            self.obj.__code__ = self.saved


@contextlib.contextmanager
def mutated(entry_id: str, target: str, edits: tuple[Edit, ...]) -> Iterator[list[Any]]:
    """Plant the edits for the block (module docstring); yields the mutated objects. Restores on exit."""
    by_target: dict[str, list[Edit]] = {}
    for e in edits:
        by_target.setdefault(e.target or target, []).append(e)
    swaps = [_Swap(entry_id, t, es) for t, es in by_target.items()]  # every check before anything changes
    jit = any(s.kind == "jit" for s in swaps)
    planted: list[_Swap] = []
    try:
        for s in swaps:
            s.plant()
            planted.append(s)
        if jit:
            drop_jit_caches()
        yield [s.obj for s in swaps]
    finally:
        for s in reversed(planted):
            s.restore()
        if jit:
            drop_jit_caches()
