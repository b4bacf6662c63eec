"""The layout of an error accumulator's state, shared by the torch fold (`errorstats`) and the Triton fold
(`errorstats_triton`): the running sums and maxima, and the log-spaced histogram of absolute errors."""

# Histogram of |error| on log10 scale: bins cover 1e-12 .. 1e6; zeros (and anything <= 1e-12) go to bin 0.
LOG_LO, LOG_HI, BINS = -12.0, 6.0, 720
STATE_SIZE = 8  # [<e,e>, <e,r>, <r,r>, <d,d>, sum |d|, finite count, max |d|, max |r|]
N_SUMS = 6  # state[:6] are sums, state[6:] maxima
