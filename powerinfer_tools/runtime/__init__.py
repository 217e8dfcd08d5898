"""Running a converted file: opening the engine, perplexity, the default model built on first use."""
