#!/usr/bin/env bash
# The engine's tests against an AddressSanitizer + UndefinedBehaviorSanitizer build of csrc/ (gcc or
# clang): builds build/sanitize/libpi_engine_asan.so, then runs the engine test files with it
# (PI_ENGINE_LIB selects it; LD_PRELOAD puts the ASan runtime first in the uninstrumented Python).
# Any sanitizer report aborts the test process, so the run fails.
#
#   scripts/sanitize_engine.sh [PYTEST ARGS...]     default: tests/engine/test_engine*.py but five long runs, and
#                                                   the families' tests (tests/arch)
#
# The five left out by default take over half of the run under ASan (minutes each) and go through code paths that
# other tests run on tiny files: a context filled to its limit (a memory-limit check), SmolLM2's top-1 agreement
# over wikitext (the q8_0 kernels on many tokens), auto mode over the real model's thresholds (the auto tests'
# kernels), the real model split with the emulated device (test_engine_device_split's tiny models) and a
# K-quant file of the real model (test_engine_gguf_types' K-quant decoders).
set -euo pipefail
cd "$(dirname "$0")/.."
CXX=${CXX:-g++}
OUT=build/sanitize
mkdir -p "$OUT"
LIB="$OUT/libpi_engine_asan.so"
scripts/build_engine_variant.sh "$CXX" "$LIB" \
    "-O1 -g -fPIC -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer" "-shared -ldl"
RUNTIME=$("$CXX" -print-file-name=libasan.so)
[ -f "$RUNTIME" ] || { echo "sanitize_engine.sh: $CXX has no libasan.so" >&2; exit 2; }
# libstdc++ preloaded too: ASan intercepts __cxa_throw only when it is present at startup.
CXXRT=$("$CXX" -print-file-name=libstdc++.so.6)
# Python's own allocations are not instrumented: leak checking would only report the interpreter.
export ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:halt_on_error=1:allocator_may_return_null=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
export PI_ENGINE_LIB="$PWD/$LIB"
if [ $# -eq 0 ]; then
    set -- tests/engine/test_engine*.py tests/arch \
        --deselect tests/engine/test_engine_resource_limits.py::test_a_context_the_check_accepts_fills_within_the_limit \
        --deselect tests/engine/test_engine_smollm2.py::test_q8_0_top1_agreement_on_wikitext \
        --deselect tests/engine/test_engine_smollm2.py::test_auto_is_dense_with_the_default_pipelines_thresholds \
        --deselect tests/engine/test_engine_device_smollm2.py::test_q8_0_split_differs_from_the_cpu_as_the_cpu_differs_from_itself \
        --deselect tests/engine/test_engine_llama_cpp_files.py::test_k_quant_file_runs_as_its_q8_0_conversion
fi
LD_PRELOAD="$RUNTIME $CXXRT" python -m pytest -q -p no:cacheprovider "$@"
