"""`pi-tools train-predictor`: predictor.py says what a predictor is and how it is stored, predictor_training.py
trains, sizes and measures them, usefulness.py holds the rules for when sparsity pays (read without torch by `run`).

Empty on purpose: usefulness.py must import without torch or numpy."""
