#!/usr/bin/env bash
# The engine's C++ sources (csrc/ but the device libraries and the fuzz target) built by another compiler or with
# other flags, for the sanitizer and fuzzing scripts: each source compiled on its own, as many at once as the
# machine has cores (one compiler call over every file uses one), then linked with any extra sources.
#
#   scripts/build_engine_variant.sh CXX OUT "COMPILE FLAGS" "LINK FLAGS" [EXTRA SOURCES...]
#   e.g. scripts/build_engine_variant.sh g++ build/sanitize/libpi_engine_asan.so "-O1 -fsanitize=address -fPIC" \
#            "-shared -ldl"
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 4 ] || { echo "usage: build_engine_variant.sh CXX OUT \"COMPILE FLAGS\" \"LINK FLAGS\" [SOURCES...]" >&2; exit 2; }
CXX=$1 OUT=$2 CFLAGS=$3 LDFLAGS=$4
shift 4
OBJ="$OUT.objects"
rm -rf "$OBJ" && mkdir -p "$OBJ"
export CXX CFLAGS OBJ
# an object is named by its source's path (csrc/model/model.cpp -> csrc_model_model.cpp.o): no two collide
find csrc -name "*.cpp" -not -path "csrc/fuzz/*" -not -path "csrc/device/*" | sort | xargs -P "$(nproc)" -I{} \
    sh -c 'o="$OBJ/$(echo "$1" | tr / _).o"; $CXX -std=c++17 -pthread -Icsrc -Icsrc/include $CFLAGS -c "$1" -o "$o"' _ {}
# shellcheck disable=SC2086  # the flags are lists of words
"$CXX" $CFLAGS "$OBJ"/*.o "$@" -Icsrc -Icsrc/include -pthread $LDFLAGS -o "$OUT"
rm -rf "$OBJ"
