#!/usr/bin/env bash
# The GPU tier's checks on a machine with a CUDA device (docs/engine.md, "The GPU tier"; docs/bench.md, "The GPU
# tier"): a peer check, never needed by CI, which compiles the CUDA library but has no device.
#
#   scripts/gpu_check.sh prepare   here, before a device run: copies what the device machine lacks into .gpu/
#                                  (git-ignored): the gguf wheel (its image has no gguf-py) and the calibration
#                                  text the synthetic model's tokenizer is trained on (../shared does not travel)
#   scripts/gpu_check.sh tests     on the device machine (carry .gpu): builds the engine and the CUDA library in
#                                  place for the device's architecture and runs the `gpu` tests (hybrid logits
#                                  against the CPU's for every type and architecture, budgets, 1000 open/close
#                                  cycles; a profile layer by layer on the GPU against the whole model there);
#                                  about 3 minutes
#   scripts/gpu_check.sh speed     on the device machine, after `tests`: a ReluLLaMA-7B-shaped q4_0 model at 90 %
#                                  predicted sparsity, decode and prompt tokens/s with the hot tier on the CPU and
#                                  on the GPU at VRAM budgets of 4 and 8 GiB (`pi-tools bench`, tables in $OUT);
#                                  about 8 minutes on 16 cores
#   scripts/gpu_check.sh sparsify  on the device machine: `pi-tools sparsify --device cuda` on a random-weight SiLU
#                                  Llama of 1.2B parameters (the 2b shape; its speed does not depend on the weights),
#                                  both phases' tokens/s, peak GPU memory, hours for 1B end-to-end tokens
#                                  ($OUT/sparsify.txt); SHAPE and DEVICE override 2b and cuda (SHAPE=tiny DEVICE=cpu
#                                  tries the command here)
#
# The device tool runs one command of at most 10 minutes: `tests` and `speed` are two calls, e.g.
#   run(command="scripts/gpu_check.sh tests", carry=[".gpu"]); run(command="scripts/gpu_check.sh speed", carry=[".gpu"])
set -euo pipefail
cd "$(dirname "$0")/.."
what="${1:-}"
OUT="${OUT:-build/gpu_check}"
mkdir -p "$OUT"

setup_device_machine() {
    # the wheels carried in .gpu/whl, the calibration text where the scripts look for it
    if ls .gpu/whl/*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl
        export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
    fi
    if [ -d .gpu/data ] && [ ! -d ../shared/data ]; then mkdir -p ../shared && cp -r .gpu/data ../shared/data; fi
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv | tee "$OUT/gpu.txt"
    fi
}

case "$what" in
prepare)
    grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
    mkdir -p .gpu/whl .gpu/data
    python="${PYTHON:-python3}"
    [ -x .venv/bin/python ] && python=.venv/bin/python
    gguf_version=$("$python" -c "import importlib.metadata as m; print(m.version('gguf'))")
    "$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d .gpu/whl "gguf==$gguf_version"
    for f in wikitext-2-valid.txt tinyshakespeare.txt; do cp ../shared/data/$f .gpu/data/; done
    du -sh .gpu
    ;;
tests)
    setup_device_machine
    # sm_90 alone: the H200 this project is lent; PI_CUDA_ARCHS overrides
    time PI_CUDA=1 PI_CUDA_ARCHS="${PI_CUDA_ARCHS:-90}" python3 setup.py -q build_ext --inplace > "$OUT/build.log" 2>&1 \
        || { tail -50 "$OUT/build.log"; exit 1; }
    set -o pipefail
    python3 -m pytest -q -p no:cacheprovider -rs tests/engine/test_engine_device.py tests/engine/test_engine_cli_gpu.py \
        tests/profile/test_profile_layers.py::test_layer_by_layer_on_cuda_equals_the_whole_model_there \
        2>&1 | tee "$OUT/tests.log"
    # the gpu tests must have run, not been skipped for want of a device
    ! grep -q "SKIPPED.*\(no CUDA device\|no CUDA library\)" "$OUT/tests.log"
    ;;
speed)
    setup_device_machine
    W=/tmp/gpu_speed
    mkdir -p "$W"
    [ -f "$W/relu7b/config.json" ] || python3 scripts/synthetic_llama.py model --shape 7b --out "$W/relu7b"
    [ -d "$W/prof" ] || python3 scripts/synthetic_llama.py profile --shape 7b --out "$W/prof"
    [ -d "$W/pred" ] || python3 scripts/synthetic_llama.py predictors --shape 7b --sparsity 0.9 --out "$W/pred"
    threads="${THREADS:-8}"
    common=(bench -m "$W/relu7b" --outtype q4_0 --predictors "$W/pred" --profile "$W/prof" --modes dense,predictor
            --peers '' --repeats 3 --n-prompt 128 --n-gen 64 -t "$threads" --work-dir "$W/bench" -q)
    python3 -m powerinfer_tools "${common[@]}" --gpu off --json "$OUT/bench-cpu.json" --markdown "$OUT/bench-cpu.md"
    for budget in 4 8; do
        python3 -m powerinfer_tools "${common[@]}" --gpu on --vram-budget "$budget" \
            --json "$OUT/bench-gpu$budget.json" --markdown "$OUT/bench-gpu$budget.md"
    done
    python3 - "$OUT" <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
for name in ("cpu", "gpu4", "gpu8"):
    rec = json.loads((out / f"bench-{name}.json").read_text())
    gpu = rec["engine"]["gpu"]
    where = (f"{gpu['device']['layers_on_device']}/{gpu['device']['hot_layers']} layers' hot tier on the GPU"
             if gpu["used"] else f"CPU ({gpu['reason']})")
    for run in rec["runs"]:
        if run["label"].startswith("ours"):
            pp, tg = run.get("pp", {}).get("median"), run["tg"]["median"]
            print(f"{name:5s} {run['label']:16s} pp {pp:8.2f} t/s  tg {tg:7.2f} t/s  {where}")
EOF
    ;;
sparsify)
    setup_device_machine
    W=/tmp/gpu_sparsify
    shape="${SHAPE:-2b}"
    [ -f "$W/silu-$shape/config.json" ] || python3 scripts/synthetic_llama.py model --shape "$shape" --act silu \
        --out "$W/silu-$shape"
    rm -rf "$W/relu"
    python3 -m powerinfer_tools sparsify -m "$W/silu-$shape" --calib ../shared/data/wikitext-2-valid.txt \
        -o "$W/relu" --device "${DEVICE:-cuda}" --seq-len 512 --batch 8 --local-tokens 16384 --local-epochs 1 \
        --tokens 65536 --eval-tokens 4096 --shift-budget 0 --checkpoint-minutes 600 > "$OUT/sparsify.log" 2>&1 \
        || { tail -c 3000 "$OUT/sparsify.log"; exit 1; }
    cp "$W/relu/sparsify.json" "$OUT/"
    python3 - "$OUT" "$W/silu-$shape" <<'EOF' | tee "$OUT/sparsify.txt"
import json, sys
from pathlib import Path
out, model = Path(sys.argv[1]), Path(sys.argv[2])
report = json.loads((out / "sparsify.json").read_text())
config = json.loads((model / "config.json").read_text())
d, f, n = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
params = n * (4 * d * d + 3 * d * f) + 2 * config["vocab_size"] * d
local = [h for h in report["history"] if h["phase"] == 1]
e2e = [h for h in report["history"] if h["phase"] == 2]
local_s = local[-1]["seconds"] if local else 0.0
rate = (e2e[-1]["tokens"] - e2e[0]["tokens"]) / (e2e[-1]["seconds"] - e2e[0]["seconds"])
peak = report.get("device_memory_peak_bytes")
print(f"{params / 1e9:.2f}B parameters on {report['device']} ({report['compute_dtype']} compute)")
print(f"layer-local: {report['tokens_seen']['layer_local']} tokens in {local_s:.0f} s for {n} layers")
print(f"end-to-end: {rate:.0f} tokens/s (steps {e2e[0]['step']}-{e2e[-1]['step']}); 1B tokens: {1e9 / rate / 3600:.1f} h")
print(f"peak device memory: {peak / 2**30:.1f} GiB" if peak else "peak device memory: not measured (no GPU)")
EOF
    ;;
*)
    sed -n 2,23p "$0"
    exit 2
    ;;
esac
