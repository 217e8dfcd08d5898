"""`pi-tools convert`: conversion.py writes the PowerInfer GGUF; dry_run.py says what it would write, and what of it
would fit in VRAM, from a model's config alone (`convert --dry-run`, `plan --dry-run`).

Empty on purpose: each module is imported by name."""
