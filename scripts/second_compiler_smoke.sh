#!/usr/bin/env bash
# The engine built by a second compiler (clang; the product's default is g++): setup.py compiles csrc/ with it into
# build/second-compiler/ (the package's own libraries stay as they are), then a tiny random llama is converted to
# f32, q8_0 and q4_0 and each file is opened, a prompt evaluated, a few tokens decoded and the model closed, with
# this library (PI_ENGINE_LIB selects it) and with the package's; their logits must agree. Code that only one
# compiler accepts, or that only one compiles as meant, fails here rather than on a user's machine (issue 53).
#
#   scripts/second_compiler_smoke.sh            CXX2=clang++-16 (or g++-11, ...) picks the compiler
set -euo pipefail
cd "$(dirname "$0")/.."
CXX2=${CXX2:-$(command -v clang++ || command -v clang++-14 || true)}
if [ -z "$CXX2" ]; then
    echo "second_compiler_smoke.sh: no second compiler (apt-get install clang-14, or set CXX2)" >&2
    exit 2
fi
OUT=build/second-compiler
rm -rf "$OUT" && mkdir -p "$OUT"
echo "building the engine with $("$CXX2" --version | head -1)"
# CC too: older setuptools compile C++ sources with CC; LDSHARED/LDCXXSHARED: Python's name the compiler it was built with
if ! CC="$CXX2" CXX="$CXX2" LDSHARED="$CXX2 -shared" LDCXXSHARED="$CXX2 -shared" PI_CUDA=0 \
        python setup.py build_ext --build-temp "$OUT/temp" --build-lib "$OUT/lib" -j "$(nproc)" >"$OUT/build.log" 2>&1; then
    tail -30 "$OUT/build.log"
    echo "second_compiler_smoke.sh: $CXX2 failed to build the engine (log: $OUT/build.log)" >&2
    exit 1
fi
LIB=$(ls "$OUT"/lib/powerinfer_engine/_pi_engine*.so)
for so in "$OUT"/lib/powerinfer_engine/*.so; do  # the version scripts hold with this compiler too
    others=$(nm -D --defined-only "$so" | awk '{print $NF}' | grep -v '^pi_' || true)
    if [ -n "$others" ]; then
        echo "second_compiler_smoke.sh: $so exports more than its C API: $(echo $others | head -c 300)" >&2
        exit 1
    fi
done
python - "$LIB" "$OUT" <<'EOF'
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, "tests")
from tiny_models import make_tiny  # noqa: E402

from powerinfer_tools.stages.conversion.conversion import convert_model  # noqa: E402

lib, out = sys.argv[1], Path(sys.argv[2])
RUN = """
import json, sys
import powerinfer_engine as engine
with engine.Model(sys.argv[1], threads=2) as m:
    prompt = list(range(3, 19))
    logits = m.eval(prompt)
    m.reset()
    tokens = list(m.generate(prompt, 8, temperature=0.0))
print(json.dumps({"library": str(engine.library_path()), "logits": logits.tolist(), "tokens": tokens}))
"""


def run(model: Path, library: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PI_ENGINE_LIB"} | ({"PI_ENGINE_LIB": library} if library else {})
    done = subprocess.run([sys.executable, "-c", RUN, str(model)], capture_output=True, text=True, env=env, timeout=300)
    if done.returncode != 0:
        sys.exit(f"second_compiler_smoke.sh: {model.name} with {library or 'the package library'} exited "
                 f"{done.returncode}: {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout)


src = make_tiny("llama-relu", out / "tiny")
for outtype in ("f32", "q8_0", "q4_0"):
    model = out / f"tiny.{outtype}.gguf"
    convert_model(str(src), model, outtype=outtype, progress=False)
    second, first = run(model, lib), run(model, None)
    assert second["library"] == lib and first["library"] != lib, (second["library"], first["library"])
    a, b = np.array(second["logits"]), np.array(first["logits"])
    worst = float(np.abs(a - b).max() / np.abs(b).max())
    print(f"{outtype}: opened, {len(a)} prompt logits, decoded {second['tokens']}; largest difference from the "
          f"package's build {worst:.1e} of the largest logit")
    if len(second["tokens"]) != 8 or not worst < 1e-3:
        sys.exit(f"second_compiler_smoke.sh: {outtype}: the second compiler's engine disagrees ({worst:.1e})")
EOF
echo "second_compiler_smoke.sh: ok ($CXX2)"
