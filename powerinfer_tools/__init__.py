"""powerinfer-tools: make and run sparsity-aware (PowerInfer) models."""

__version__ = "0.1.0"
