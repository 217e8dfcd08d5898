#!/usr/bin/env bash
# Coverage-guided fuzzing of the engine's file readers (libFuzzer + ASan/UBSan; needs clang, the
# product does not): builds csrc/fuzz/fuzz_load.cpp with the engine sources into build/fuzz/, then
# fuzzes for SECONDS (default 120) from the seed corpus tests/fuzz_corpus/. Inputs found along the way
# go to build/fuzz/corpus/ (not the repository); a crashing input is written to build/fuzz/crashes/
# and the script exits non-zero: minimize it, fix the loader, keep it under tests/fuzz_regressions/
# (tests/engine/test_fuzz_inputs.py loads it; fuzzing reuses it as a seed).
#
#   scripts/fuzz_engine.sh [SECONDS] [JOBS]      e.g. scripts/fuzz_engine.sh 600 2
#
# PI_FUZZ_RUNS=N (CI sets it) makes the run reproducible: a fixed seed and N inputs instead of a time
# limit, so a commit's CI result does not depend on luck or machine speed; open-ended hunting for new
# bugs is the timed mode, run by hand.
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS_TO_RUN=${1:-120}
JOBS=${2:-1}
CXX=${CXX_FUZZ:-$(command -v clang++ || command -v clang++-14 || true)}
if [ -z "$CXX" ]; then
    echo "fuzz_engine.sh: clang++ is needed for libFuzzer (apt-get install clang libclang-rt-14-dev)" >&2
    exit 2
fi
OUT=build/fuzz
mkdir -p "$OUT/corpus" "$OUT/crashes"
scripts/build_engine_variant.sh "$CXX" "$OUT/fuzz_load" \
    "-g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer" "-ldl" \
    csrc/fuzz/fuzz_load.cpp
if [ -n "${PI_FUZZ_RUNS:-}" ]; then echo "built $OUT/fuzz_load; fuzzing $PI_FUZZ_RUNS inputs from seed 1"
else echo "built $OUT/fuzz_load; fuzzing for ${SECONDS_TO_RUN}s with $JOBS job(s)"; fi
# -rss_limit_mb/-malloc_limit_mb: a file that makes the loader allocate over 1 GiB counts as a crash
# (resource limits are part of what is tested). Regression inputs are seeds too, so fixes stay fixed.
ARGS=(-rss_limit_mb=2048 -malloc_limit_mb=1024 -max_len=65536 -timeout=10
      -artifact_prefix="$OUT/crashes/" -print_final_stats=1)
CORPUS="$OUT/corpus"
if [ -n "${PI_FUZZ_RUNS:-}" ]; then
    CORPUS="$OUT/corpus-seed1"  # starts empty each time, as on a clean clone
    rm -rf "$CORPUS" && mkdir -p "$CORPUS"
    ARGS+=(-seed=1 -runs="$PI_FUZZ_RUNS")
else
    ARGS+=(-max_total_time="$SECONDS_TO_RUN")
    if [ "$JOBS" -gt 1 ]; then ARGS+=(-fork="$JOBS" -ignore_crashes=0); fi
fi
DIRS=("$CORPUS" tests/fuzz_corpus)
[ -d tests/fuzz_regressions ] && DIRS+=(tests/fuzz_regressions)
set +e
ASAN_OPTIONS=detect_leaks=1 "$OUT/fuzz_load" "${ARGS[@]}" "${DIRS[@]}" >"$OUT/fuzz.log" 2>&1
status=$?
set -e
grep -E "INITED|DONE|stat::|ERROR|SUMMARY|Done [0-9]+ runs" "$OUT/fuzz.log" | tail -20
crashes=$(find "$OUT/crashes" -type f | wc -l)
echo "fuzz_engine.sh: exit $status, $crashes crashing input(s) in $OUT/crashes; log $OUT/fuzz.log"
[ "$status" -eq 0 ] && [ "$crashes" -eq 0 ]
