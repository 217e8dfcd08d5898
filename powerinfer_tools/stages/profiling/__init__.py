"""`pi-tools profile` and the readers of what it writes: profiling.py runs it (profile_layers.py one decoder layer
at a time, profile_files.py the files and digests a resume checks), calibration.py gives its token sequences,
input_sparsity.py its per-layer input thresholds, locality.py the verdict read from its counts.

Empty on purpose: each module is imported by name, so reading counts costs no transformers import."""
