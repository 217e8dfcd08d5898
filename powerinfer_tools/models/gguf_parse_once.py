"""transformers reading a GGUF source: each file parsed once, gguf-py's tensor-name map built once.

transformers' GGUF loader (`transformers.modeling_gguf_pytorch_utils.load_gguf_checkpoint`) parses the whole file
with gguf-py for the config, again for the weights and again for the tokenizer (every vocabulary string each
time), and `get_gguf_hf_weights_map` rebuilds gguf-py's tensor-name map for each module of the model as it
recurses through them: for a small model such as SmolLM2 that is most of its loading time. The loader imports
`gguf.GGUFReader` and `gguf.get_tensor_name_map` when it is called, so inside `parse_once()` those two names answer
from caches: readers by the file's identity (path, inode, size and modification time: a file rewritten in place
is parsed again), name maps by their arguments. Readers are read-only views of their file.
"""
from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections import OrderedDict

_KEEP = 4                       # readers kept: a source's config, weights and tokenizer read one file
_lock = threading.RLock()       # the two names are the gguf module's: one patch at a time
_readers: OrderedDict = OrderedDict()


def _identity(path) -> tuple:
    st = os.stat(path)
    return os.path.realpath(path), st.st_ino, st.st_size, st.st_mtime_ns


@contextlib.contextmanager
def parse_once():
    import gguf

    real_reader, real_map = gguf.GGUFReader, gguf.get_tensor_name_map

    def reader(path, mode="r"):
        key = (_identity(path), mode)
        if key in _readers:
            _readers.move_to_end(key)
        else:
            _readers[key] = real_reader(path, mode)
            while len(_readers) > _KEEP:
                _readers.popitem(last=False)
        return _readers[key]

    with _lock:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.lru_cache(maxsize=None)(real_map)
        try:
            yield
        finally:
            gguf.GGUFReader, gguf.get_tensor_name_map = real_reader, real_map
