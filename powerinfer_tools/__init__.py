"""powerinfer-tools: make and run sparsity-aware (PowerInfer) models.

    from powerinfer_tools import LLM    # text in, text out (powerinfer_tools.runtime.llm)
"""

__version__ = "0.1.0"

__all__ = ["LLM", "__version__"]


def __getattr__(name):
    # LLM loads the engine binding and the tokenizers library: only when asked for, so the CLI starts fast
    if name == "LLM":
        from powerinfer_tools.runtime.llm import LLM

        return LLM
    raise AttributeError(f"module 'powerinfer_tools' has no attribute {name!r}")
