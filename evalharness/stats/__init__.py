"""Statistics for the numerical-correctness harness (FP8 engine vs FP32 reference).

All functions take array-likes and return plain Python floats/ints/bools/lists/dicts
(JSON-serialisable), never numpy scalars; bootstraps are deterministic given ``seed``.

Sign convention: comparisons are "b/y (candidate) minus a/x (baseline)".

Modules:
    intervals    mean_ci, binomial_ci, quantile_ci, bootstrap_ci
    perplexity   ppl_ci, ppl_ratio_ci
    paired       mcnemar_exact, paired_bootstrap_delta, flip_rates, discordance_rate,
                 discordant_counts
    comparisons  paired_test, tost_equivalence, noninferiority
    multiple     holm, benjamini_hochberg
    power        mde_paired_proportions, required_n_paired_proportions,
                 mde_mean_diff, required_n_mean_diff
"""

from .comparisons import noninferiority, paired_test, tost_equivalence
from .intervals import binomial_ci, bootstrap_ci, mean_ci, quantile_ci
from .multiple import benjamini_hochberg, holm
from .paired import (discordance_rate, discordant_counts, flip_rates, mcnemar_exact,
                     paired_bootstrap_delta)
from .perplexity import ppl_ci, ppl_ratio_ci
from .power import (DEFAULT_DISCORDANCE, mde_mean_diff, mde_paired_proportions,
                    required_n_mean_diff, required_n_paired_proportions)

__all__ = [
    "mean_ci", "binomial_ci", "quantile_ci", "bootstrap_ci",
    "ppl_ci", "ppl_ratio_ci",
    "mcnemar_exact", "paired_bootstrap_delta", "flip_rates", "discordance_rate",
    "discordant_counts",
    "paired_test", "tost_equivalence", "noninferiority",
    "holm", "benjamini_hochberg",
    "mde_paired_proportions", "required_n_paired_proportions", "mde_mean_diff",
    "required_n_mean_diff", "DEFAULT_DISCORDANCE",
]
