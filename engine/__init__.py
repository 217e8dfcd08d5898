"""Python binding of the bundled C++ engine (csrc/), imported as `powerinfer_engine`: load a PowerInfer GGUF file
and run it on token ids (`powerinfer_tools.LLM` is the text-level API on top of it).

    import powerinfer_engine

    with powerinfer_engine.Model("model.powerinfer.gguf", threads=2, sparse_mode="gate") as m:
        logits = m.eval(tokens)
        for token in m.generate(tokens, 32):
            ...

The source folder is `engine/`; `import engine`, this package's name until 0.1.0, still works for one release
and warns: it is the same package under the old name.
"""
import sys as _sys

if __name__ != "powerinfer_engine":  # imported by its old name: hand over the one package, submodules included
    import importlib as _importlib
    import warnings as _warnings

    _warnings.warn("the engine binding is imported as 'powerinfer_engine' now; 'import engine' goes away in the "
                   "next release", DeprecationWarning, stacklevel=2)
    _package = _importlib.import_module("powerinfer_engine")
    for _name in ("_lib", "files", "kernels", "library_check", "memory", "model"):
        _sys.modules[f"{__name__}.{_name}"] = _importlib.import_module(f"powerinfer_engine.{_name}")
    _sys.modules[__name__] = _package
else:
    from ._lib import FFN_MODES, GPU_MODES, KV_TYPES, EngineError, device_library_path, library_path
    from .files import check_gguf
    from .memory import read_rows_rate
    from .model import Model

    __all__ = ["Model", "EngineError", "check_gguf", "FFN_MODES", "GPU_MODES", "KV_TYPES", "device_library_path",
               "library_path", "read_rows_rate"]
