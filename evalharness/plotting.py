"""Plotting without a display: the one place the harness imports matplotlib (an optional dependency of
`report` and `trend`)."""

from __future__ import annotations


def pyplot():
    """matplotlib.pyplot on the Agg backend."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt
