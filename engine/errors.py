"""Errors raised by the engine for bad input (configs, checkpoints, recipes).

Every message says what was wrong, where (file, key or tensor name) and what to do.
"""


class EngineError(ValueError):
    """Base class of the engine's bad-input errors."""


class ConfigError(EngineError):
    """A model config (HF `config.json`) is missing a key or holds an unsupported value."""


class WeightsError(EngineError):
    """A checkpoint is missing, corrupt, or does not fit the model config."""


class RecipeError(EngineError):
    """A precision recipe is malformed (unknown key, bad format string, cyclic `extends`)."""


class CheckpointError(EngineError):
    """A llama2.c checkpoint is unreadable: bad header, wrong size, or missing.

    The message always names the file, what was expected vs. what was found,
    and what to do about it.
    """


class TokenizerError(EngineError):
    """A tokenizer file is truncated, corrupt or not a tokenizer of the expected kind."""


class TokenizerMismatchError(EngineError):
    """A tokenizer cannot be used with a model (vocab or special ids out of range)."""
