"""When sparsity pays: the rules the profile's verdict, the predictors' training and `run`'s closing note share.

Kept free of torch and numpy: `run` reads them after the engine has sized its memory against a limit, where a
heavy import would push the process over it.
"""
from __future__ import annotations

# A predictor is worth running where it ranks active neurons above inactive ones clearly better than chance
# (held-out AUC 0.5) and leaves at least half the neurons out at its threshold: with more marked active, a sparse
# step saves less than choosing the neurons costs, and a poor ranking drops neurons at random on text unlike the
# calibration text.
MIN_USEFUL_AUC = 0.6
MAX_USEFUL_DENSITY = 0.5
# The profile's verdict and run's note call a model sparse enough where at least this share of neurons is
# inactive for a token: the same line as the predictors'.
ENOUGH_SPARSITY = 1 - MAX_USEFUL_DENSITY
