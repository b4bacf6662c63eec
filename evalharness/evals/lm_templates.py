"""Compile each of lm-eval's prompt templates once instead of once per document.

lm-eval renders every ``doc_to_text`` / ``doc_to_target`` / ``doc_to_choice`` Jinja template through
``lm_eval.utils.apply_template``, which calls ``env.from_string(template)``: Jinja parses and compiles the template
again for each document and each few-shot example. For MMLU (570 documents, 5-shot) that is ~4,000 compilations of
a handful of distinct strings, ~10 s per model pass on a CPU core, most of a zoo-sized model's task time.

:func:`compiled_templates` swaps lm-eval's module-level environment for one that keeps the compiled template of
each source string (same loader, undefined-handling, newline and filter settings), for the duration of the block.
Rendering a compiled Jinja template has no state, so prompts are identical (the harness checks prompt hashes of
the engine against the reference's, and ``tests/evalharness/evals/test_lm_templates.py`` compares every prompt of
the tasks with and without it).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator

from jinja2 import Environment

log = logging.getLogger(__name__)


class CachingEnvironment(Environment):
    """A Jinja environment whose ``from_string`` compiles each source string once (plain calls only)."""

    compiled: dict[str, Any]

    @classmethod
    def like(cls, original: Environment) -> "CachingEnvironment":
        """A caching environment with `original`'s settings, filters, tests and globals (shared, not copied)."""
        env = cls.__new__(cls)
        env.__dict__.update(original.__dict__)
        env.compiled = {}
        return env

    def from_string(self, source, globals=None, template_class=None):  # noqa: A002 (Jinja's signature)
        if globals is not None or template_class is not None or not isinstance(source, str):
            return super().from_string(source, globals, template_class)
        template = self.compiled.get(source)
        if template is None:
            template = self.compiled[source] = super().from_string(source)
        return template


_CACHED: dict[int, Any] = {}  # id(lm-eval's environment) -> its caching copy, kept across runs of one process


@contextlib.contextmanager
def compiled_templates() -> Iterator[None]:
    """Within the block, lm-eval compiles each distinct template string once (kept for later blocks too)."""
    try:
        import lm_eval.utils as lm_utils
    except ImportError:  # lm-eval missing: the tasks eval reports that itself
        yield
        return
    original = getattr(lm_utils, "env", None)
    if not isinstance(original, Environment):
        log.info("lm_eval.utils.env is not a Jinja environment in this lm-eval version; templates compile per use")
        yield
        return
    cached = _CACHED.get(id(original))
    if cached is None:
        cached = _CACHED[id(original)] = CachingEnvironment.like(original)
    lm_utils.env = cached
    try:
        yield
    finally:
        lm_utils.env = original
