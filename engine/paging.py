"""The paged KV cache, importable without Triton (see `engine.kernels.paged_cache`)."""
from engine.kernels.paged_cache import PagedKVCache  # noqa: F401
