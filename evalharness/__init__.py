"""evalharness: runs an engine next to an FP32 reference, measures, gates, logs.

The harness talks to an engine only through `engine.api`'s narrow interface
(`logits(tokens, tap=...)`, `generate(prompt, ...)`), so other engines can be
plugged in. Result JSON files are the source of truth; gates, reports and
mlflow are views computed from them.
"""

__version__ = "0.1.0"
