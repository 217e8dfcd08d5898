"""Files as PowerInfer's own tools write them (SJTU-IPADS/PowerInfer d3ebd7c), built byte by byte here so that
they do not pass through the gguf-py version we write with: its gpu index (powerinfer-py's export_split.py,
with its bundled gguf-py, whose I32 is 18 as in its ggml.h), and a raw reader of a file's tensor table."""
from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

POWERINFER_I32 = 18  # PowerInfer's ggml.h: enum ggml_type ... Q8_K = 15, I8, I16, I32
_ALIGN = 32
_U32, _U64, _STR, _ARR = 4, 10, 8, 9
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def _string(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def write_powerinfer_gpuidx(path: Path, masks: list[np.ndarray], vram_capacity: int) -> Path:
    """What `python -m powerinfer` writes: per layer blk.N.gpu_idx (i32 [n_ff], 1 = GPU) then blk.N.gpu_bucket
    (its sorted GPU neurons), both of type 18; general.architecture = generic.gpu_index, then
    generic.gpu_index.block_count (u32) and split.vram_capacity (u64); magic PWRI, version 3."""
    tensors = []
    for i, mask in enumerate(masks):
        tensors.append((f"blk.{i}.gpu_idx", np.asarray(mask, np.int32)))
        tensors.append((f"blk.{i}.gpu_bucket", np.flatnonzero(mask).astype(np.int32)))
    kv = (_string("general.architecture") + struct.pack("<I", _STR) + _string("generic.gpu_index")
          + _string("generic.gpu_index.block_count") + struct.pack("<II", _U32, len(masks))
          + _string("split.vram_capacity") + struct.pack("<IQ", _U64, vram_capacity))
    infos, data = b"", b""
    for name, values in tensors:
        data += b"\0" * (-len(data) % _ALIGN)
        infos += _string(name) + struct.pack("<IQIQ", 1, values.size, POWERINFER_I32, len(data))
        data += values.tobytes()
    head = b"PWRI" + struct.pack("<IQQ", 3, len(tensors), 3) + kv + infos
    path.write_bytes(head + b"\0" * (-len(head) % _ALIGN) + data)
    return path


def tensor_types(path: Path) -> dict[str, int]:
    """name -> the raw ggml type id in the file's tensor table."""
    buf = Path(path).read_bytes()
    at = 4 + 4
    n_tensors, n_kv = struct.unpack_from("<QQ", buf, at)
    at += 16

    def string() -> str:
        nonlocal at
        (n,) = struct.unpack_from("<Q", buf, at)
        at += 8 + n
        return buf[at - n:at].decode()

    def value(vtype: int) -> None:
        nonlocal at
        if vtype == _STR:
            string()
        elif vtype == _ARR:
            sub, count = struct.unpack_from("<IQ", buf, at)
            at += 12
            for _ in range(count):
                value(sub)
        else:
            at += struct.calcsize(_SCALAR[vtype])

    for _ in range(n_kv):
        string()
        (vtype,) = struct.unpack_from("<I", buf, at)
        at += 4
        value(vtype)
    types = {}
    for _ in range(n_tensors):
        name = string()
        (n_dims,) = struct.unpack_from("<I", buf, at)
        at += 4 + 8 * n_dims
        types[name] = struct.unpack_from("<I", buf, at)[0]
        at += 4 + 8
    return types
