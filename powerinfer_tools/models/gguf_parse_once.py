"""transformers reading a GGUF source: the file parsed once per load, gguf-py's tensor-name map built once.

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


def _identity(path) -> tuple:
    st = os.stat(path)
    return os.path.realpath(path), st.st_ino, st.st_size, st.st_mtime_ns


class _Patch:
    """The two names patched while any parse_once() is active (re-entrant: load_model reads the config inside
    its own); the readers dropped when the outermost one ends (a reader of SmolLM2 holds 160 MiB of parsed fields)."""

    def __init__(self):
        self.lock = threading.RLock()  # the names are the gguf module's: one loading thread at a time
        self.depth = 0
        self.readers: dict = {}

    def enter(self, gguf) -> None:
        if self.depth == 0:
            self.real = gguf.GGUFReader, gguf.get_tensor_name_map
            patch = self

            class Reader(gguf.GGUFReader):
                """A class still (another module may subclass gguf.GGUFReader meanwhile: gguf_io does); called by
                itself it answers a cached gguf.GGUFReader, whose __init__ Python then does not run again."""

                def __new__(cls, path, mode="r", *args, **kwargs):
                    if cls is not Reader or args or kwargs:
                        return super().__new__(cls)
                    return patch.reader(path, mode)

            gguf.GGUFReader, gguf.get_tensor_name_map = Reader, functools.lru_cache(maxsize=None)(self.real[1])
        self.depth += 1

    def leave(self, gguf) -> None:
        self.depth -= 1
        if self.depth == 0:
            gguf.GGUFReader, gguf.get_tensor_name_map = self.real
            self.readers.clear()

    def reader(self, path, mode="r"):
        key = (_identity(path), mode)
        if key not in self.readers:
            self.readers[key] = self.real[0](path, mode)
        return self.readers[key]


_patch = _Patch()


@contextlib.contextmanager
def parse_once():
    import gguf

    with _patch.lock:
        _patch.enter(gguf)
        try:
            yield
        finally:
            _patch.leave(gguf)
