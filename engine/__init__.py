"""The FP8 unified low-precision dataflow engine.

`engine` never imports `evalharness`. The harness talks to it through
`engine.api` (score tokens, generate, expose taps) only.
"""

__version__ = "0.1.0"
