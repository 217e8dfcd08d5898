"""Python binding of the bundled C++ engine (csrc/): load a PowerInfer GGUF file and run it.

    with engine.Model("model.powerinfer.gguf", threads=2, sparse_mode="gate") as m:
        logits = m.eval(tokens)
        for token in m.generate(tokens, 32):
            ...
"""
from engine._lib import FFN_MODES, GPU_MODES, KV_TYPES, EngineError, device_library_path, library_path
from engine.files import check_gguf
from engine.memory import read_rows_rate
from engine.model import Model

__all__ = ["Model", "EngineError", "check_gguf", "FFN_MODES", "GPU_MODES", "KV_TYPES", "device_library_path",
           "library_path", "read_rows_rate"]
