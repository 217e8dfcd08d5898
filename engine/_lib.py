"""Finding and binding the compiled engine (csrc/, built as engine/_pi_engine*.so) with ctypes, and the device
libraries it may load (csrc/device/: engine/_pi_cuda*.so where nvcc was found at install time, and the host
emulation engine/_pi_device_emulated*.so the tests use in place of a GPU).

The libraries are looked up inside this package, where `pip install` / `setup.py build_ext --inplace`
put them; the environment variable PI_ENGINE_LIB names another engine build to use instead, PI_GPU_LIBRARY
another device library.
"""
from __future__ import annotations

import ctypes
import operator
import os
from functools import lru_cache
from pathlib import Path

from .library_check import LibraryRefused, check_library

LIBRARY_ENV = "PI_ENGINE_LIB"
API_VERSION = 20

FFN_MODES = {"dense": 0, "gate": 1, "predictor": 2, "auto": 3, "oracle": 4}
KV_TYPES = {"f32": 0, "f16": 1, "q8_0": 2}
GPU_MODES = {"off": 0, "auto": 1, "on": 2}
GPU_LIBRARY_ENV = "PI_GPU_LIBRARY"
DEVICE_LIBRARIES = {"cuda": "_pi_cuda", "emulated": "_pi_device_emulated"}


# the engine's status codes (pi_engine.h, pi_status)
ERR_IO, ERR_FORMAT, ERR_UNSUPPORTED, ERR_ARGUMENT, ERR_MEMORY, ERR_INTERNAL = range(1, 7)


class EngineError(RuntimeError):
    """A failure reported by the engine (bad file, bad argument, ...), carrying its one-line message."""

    def __init__(self, message: str, status: int = 0):
        super().__init__(message)
        self.status = status

    @property
    def during_a_run_is_the_callers(self) -> bool:
        """Whether, raised while evaluating or sampling, it is the caller's doing (an argument: a token id, a full
        context) rather than the machine's or the file's (a read that failed, memory, a damaged bundle)."""
        return self.status in (0, ERR_ARGUMENT)


class Options(ctypes.Structure):
    _fields_ = [("threads", ctypes.c_int32), ("ctx_size", ctypes.c_int32), ("batch_size", ctypes.c_int32),
                ("ffn_mode", ctypes.c_int32), ("recall_check", ctypes.c_int32), ("gpuidx_path", ctypes.c_char_p),
                ("isa", ctypes.c_char_p), ("kv_type", ctypes.c_int32), ("gpu", ctypes.c_int32),
                ("gpu_device", ctypes.c_int32), ("vram_budget", ctypes.c_int64), ("gpu_library", ctypes.c_char_p),
                ("gpu_ffn_only", ctypes.c_int32), ("input_sparsity", ctypes.c_float),
                ("cpu_hot_tier", ctypes.c_int32), ("decode_cache", ctypes.c_char_p),
                ("memory_budget", ctypes.c_int64), ("n_seq", ctypes.c_int32),
                ("expert_lookahead", ctypes.c_int32)]


class Sampling(ctypes.Structure):
    _fields_ = [("temperature", ctypes.c_float), ("top_k", ctypes.c_int32), ("top_p", ctypes.c_float),
                ("repeat_penalty", ctypes.c_float), ("repeat_last_n", ctypes.c_int32),
                ("frequency_penalty", ctypes.c_float), ("presence_penalty", ctypes.c_float)]


def _built(stem: str) -> list[Path]:
    here = Path(__file__).resolve().parent
    return sorted(here.glob(f"{stem}*.so")) + sorted(here.glob(f"{stem}*.dylib")) + sorted(here.glob(f"{stem}*.pyd"))


def device_library_path(kind: str = "cuda") -> Path | None:
    """The device library of `kind` ("cuda", or "emulated" for tests) built into this package, or None (the CUDA
    one exists only where nvcc was found at install time); PI_GPU_LIBRARY overrides the CUDA one."""
    if kind not in DEVICE_LIBRARIES:
        raise EngineError(f"unknown device library {kind!r} (choose from {', '.join(DEVICE_LIBRARIES)})")
    override = os.environ.get(GPU_LIBRARY_ENV)
    if kind == "cuda" and override:
        return Path(override)
    found = _built(DEVICE_LIBRARIES[kind])
    return found[0] if found else None


def library_path() -> Path:
    override = os.environ.get(LIBRARY_ENV)
    if override:
        path = Path(override)
        if not path.is_file():
            raise EngineError(f"{LIBRARY_ENV}={override} does not name a file")
        return path
    here = Path(__file__).resolve().parent
    found = _built("_pi_engine")
    if not found:
        raise EngineError(f"the compiled engine is missing from {here}: reinstall with `pip install .` or run "
                          "`python setup.py build_ext --inplace` in the source tree")
    return found[0]


_P = ctypes.c_void_p
_I32 = ctypes.c_int32
_SIGNATURES = {
    "pi_last_error": (ctypes.c_char_p, []),
    "pi_api_version": (_I32, []),
    "pi_options_default": (None, [ctypes.POINTER(Options)]),
    "pi_sampling_default": (None, [ctypes.POINTER(Sampling)]),
    "pi_open": (_I32, [ctypes.c_char_p, ctypes.POINTER(Options), ctypes.POINTER(_P)]),
    "pi_close": (None, [_P]),
    "pi_check_gguf": (_I32, [ctypes.c_char_p]),
    "pi_info_json": (_I32, [_P, ctypes.POINTER(ctypes.c_char_p)]),
    "pi_set_ffn_mode": (_I32, [_P, _I32]),
    "pi_set_recall_check": (_I32, [_P, _I32]),
    "pi_set_expert_trace": (_I32, [_P, _I32]),
    "pi_expert_choices": (_I32, [_P, _P, _I32]),
    "pi_set_input_sparsity": (_I32, [_P, ctypes.c_float]),
    "pi_eval": (_I32, [_P, _P, _I32, _P, _I32]),
    "pi_eval_hidden": (_I32, [_P, _P, _I32, _P]),
    "pi_n_past": (_I32, [_P]),
    "pi_truncate": (_I32, [_P, _I32]),
    "pi_set_sequence": (_I32, [_P, _I32]),
    "pi_decode_step": (_I32, [_P, _P, _P, _I32, _P]),
    "pi_sample": (_I32, [_P, ctypes.POINTER(Sampling), ctypes.POINTER(_I32)]),
    "pi_sample_masked": (_I32, [_P, ctypes.POINTER(Sampling), _P, _I32, ctypes.POINTER(_I32)]),
    "pi_set_seed": (_I32, [_P, ctypes.c_uint64]),
    "pi_stats_json": (_I32, [_P, ctypes.POINTER(ctypes.c_char_p)]),
    "pi_stats_reset": (_I32, [_P]),
}
# csrc/include/pi_engine_testing.h: single kernels, the read probe, the memory limits, another hot-tier backend
_TESTING_SIGNATURES = {
    "pi_open_with_hot_backend": (_I32, [ctypes.c_char_p, ctypes.POINTER(Options), ctypes.c_char_p, ctypes.POINTER(_P)]),
    "pi_isa_available": (_I32, [ctypes.c_char_p]),
    "pi_isa_selected": (ctypes.c_char_p, []),
    "pi_kernel_dot": (_I32, [ctypes.c_char_p, _I32, _I32, _P, _P, ctypes.POINTER(ctypes.c_float)]),
    "pi_kernel_axpy": (_I32, [ctypes.c_char_p, _I32, _I32, ctypes.c_float, _P, _P]),
    "pi_kernel_dot4": (_I32, [ctypes.c_char_p, _I32, _I32, _P, _P, _P]),
    "pi_kernel_dot_rows": (_I32, [ctypes.c_char_p, _I32, _I32, _I32, _P, _P, _P]),
    "pi_kernel_axpy_rows": (_I32, [ctypes.c_char_p, _I32, _I32, _I32, _P, _I32, _P, _P]),
    "pi_kernel_pack8": (_I32, [_I32, _I32, _P, _P]),
    "pi_kernel_pack_quads": (_I32, [_I32, _I32, _P, _P]),
    "pi_kernel_axpy_quads": (_I32, [ctypes.c_char_p, _I32, _I32, _P, _P, _P]),
    "pi_kernel_pack_columns8": (_I32, [ctypes.c_char_p, _I32, _I32, _P, _I32, _I32, _P]),
    "pi_kernel_gemm8": (_I32, [ctypes.c_char_p, _I32, _I32, _I32, _P, _I32, _P, _P]),
    "pi_kernel_pack_columns": (_I32, [_I32, _I32, _I32, _P, _I32, _I32, _P]),
    "pi_kernel_gemv_columns": (_I32, [ctypes.c_char_p, _I32, _I32, _I32, _I32, _P, _P, _I32, _I32, _P]),
    "pi_kernel_gemm_f32": (_I32, [ctypes.c_char_p, _I32, _I32, _I32, _P, _P, _P]),
    "pi_kernel_gemm_f16": (_I32, [ctypes.c_char_p, _I32, _I32, _I32, _P, _P, _P]),
    "pi_kernel_gemm_q8": (_I32, [ctypes.c_char_p, _I32, _I32, _I32, _I32, _P, _P, _P, _P]),
    "pi_kernel_silu": (_I32, [ctypes.c_char_p, _I32, _P, _P]),
    "pi_kernel_softmax": (_I32, [ctypes.c_char_p, _I32, ctypes.c_float, _P]),
    "pi_kernel_to_float": (_I32, [ctypes.c_char_p, _I32, _I32, _P, _P]),
    "pi_kernel_quantize_q8_0": (_I32, [ctypes.c_char_p, _I32, _P, _P]),
    "pi_read_rows_rate": (_I32, [ctypes.c_uint64, ctypes.c_double, _I32, ctypes.c_uint64, _I32,
                                 ctypes.POINTER(ctypes.c_double)]),
    "pi_memory_limits": (_I32, [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_double, ctypes.POINTER(ctypes.c_double),
                                ctypes.POINTER(ctypes.c_double)]),
}


@lru_cache(maxsize=1)
def lib() -> ctypes.CDLL:
    path = library_path()
    try:
        check_library(path, list(_SIGNATURES) + list(_TESTING_SIGNATURES))
    except LibraryRefused as exc:
        raise EngineError(f"{path} cannot be the engine library: {exc}") from None
    try:
        handle = ctypes.CDLL(str(path))
    except OSError as exc:
        raise EngineError(f"cannot load the engine library {path}: {exc}") from None
    # the version first: an older library lacks some of the functions bound below
    if handle.pi_api_version() != API_VERSION:
        raise EngineError(f"{path} speaks engine API {handle.pi_api_version()}, this package expects {API_VERSION}: rebuild it")
    for name, (restype, argtypes) in {**_SIGNATURES, **_TESTING_SIGNATURES}.items():
        fn = getattr(handle, name)
        fn.restype = restype
        fn.argtypes = argtypes
    return handle


INT32_MAX = 2**31 - 1
UINT64_MAX = 2**64 - 1


def c_int(name: str, value, lo: int = -INT32_MAX - 1, hi: int = INT32_MAX) -> int:
    """`value` as a Python int within [lo, hi] (by default the range of the C int32_t it becomes). ctypes
    keeps only the low bits of a larger int, and `int()` would truncate a float or parse a string: both
    are refused here, before the value crosses into the engine."""
    try:
        number = operator.index(value)  # ints and numpy integers; not floats, strings or None
    except TypeError:
        raise EngineError(f"{name} must be an integer, not {type(value).__name__} {value!r}") from None
    if not lo <= number <= hi:
        raise EngineError(f"{name} = {number} is out of range ({lo} to {hi})")
    return number


def c_float(name: str, value) -> float:
    """`value` as a float for a C float parameter; a string, None or a bool is refused instead of a TypeError or a
    silent 1.0, and so is a number the C float would round to 0 (1e-300 would turn a mode off)."""
    if isinstance(value, (str, bytes, bool)) or not hasattr(value, "__float__"):
        raise EngineError(f"{name} must be a number, not {type(value).__name__} {value!r}")
    number = float(value)
    if number != 0 and ctypes.c_float(number).value == 0:
        raise EngineError(f"{name} = {value!r} is too small for the engine's float: it would be 0")
    return number


def check(status: int) -> None:
    """Raise EngineError with the engine's message when a call failed."""
    if status != 0:
        raise EngineError(lib().pi_last_error().decode("utf-8", "replace"), status)
