#!/usr/bin/env bash
# The GPU tier's checks on a machine with a CUDA device (docs/engine.md, "The GPU tier"; docs/bench.md, "The GPU
# tier"): a peer check, never needed by CI, which compiles the CUDA library but has no device.
#
#   scripts/gpu_check.sh prepare   here, before a device run: copies what the device machine lacks into .gpu/
#                                  (git-ignored): the gguf wheel (its image has no gguf-py), the calibration
#                                  text the synthetic model's tokenizer is trained on (../shared does not travel),
#                                  with PI_POWERINFER_SRC cmake's wheel (for the peer's build), and `prepare-peer`
#   scripts/gpu_check.sh prepare-peer  PI_POWERINFER_SRC=DIR (a PowerInfer checkout, SJTU-IPADS/PowerInfer at
#                                  d3ebd7c): packs its source, without models/, smallthinker/ and .git, into
#                                  .gpu/powerinfer-src.tar.gz with its commit beside (GPU_DIR overrides .gpu);
#                                  nothing fetched is committed. Unset: says the peer rows will be missing
#   scripts/gpu_check.sh all       on the device machine (carry .gpu), ONE call of at most 10 minutes: `peer-build`
#                                  started in the background, `build` (ours), `smoke` (it stops there on a crash or a
#                                  hang: it needs our CUDA library, so it follows our build), `tests`, then `speed`
#                                  (which waits for the peer's build before its peer rows), each under a time limit
#                                  of its own (150 s, 60, 150, what is left of 9.5 minutes), appending what it
#                                  finished to $OUT/progress.txt as it goes, so that a call cut short still says
#                                  how far it got and what it measured (ALL_SECONDS: the whole budget, 570)
#   scripts/gpu_check.sh peer-build  PowerInfer's `main` with CUDA (-DLLAMA_CUBLAS=ON) for the card's architecture
#                                  alone, from .gpu/powerinfer-src.tar.gz into $PEER_DIR (/tmp/powerinfer):
#                                  $PEER_DIR/build/bin/main; its log $OUT/peer-build.log
#   scripts/gpu_check.sh smoke     (after build) seconds: tiny models opened and decoded on the CPU and on CUDA (f32,
#                                  q8_0, q4_0; the device ABI called directly); a crash is rerun under cuda-gdb for
#                                  its backtrace ($OUT/smoke.log, $OUT/backtrace.txt)
#   scripts/gpu_check.sh build     the engine and the CUDA library in place, for the device's architecture
#   scripts/gpu_check.sh tests     (after build) the `gpu` tests on CUDA: the split's logits against the CPU's for
#                                  every type and architecture with the layers' attention and KV cache on the
#                                  device and without, a long context, truncate/reset, budgets, 1000 open/close
#                                  cycles; a profile layer by layer on the GPU against the whole model there
#   scripts/gpu_check.sh speed     (after build) a ReluLLaMA-7B-shaped q4_0 model of LAYERS layers (default 4 of
#                                  32: the layers are alike, so per-layer rates hold) at 90 % predicted sparsity, the
#                                  predictor mode (MODES=dense,predictor adds dense; REPEATS rounds, default 1):
#                                  prompt and decode tokens/s on the CPU alone, then on the GPU at a hybrid budget
#                                  (about half the hot rows on the device), the 7B's 4 and 8 GiB budgets scaled to
#                                  LAYERS, with the layers' attention and KV cache on the device, and at 8 GiB
#                                  without them ($OUT/speed.txt, the bench's tables; the
#                                  device's steps timed by CUDA events: $OUT/steps-NAME.tsv, PI_CUDA_STEP_TIMES);
#                                  SHAPE overrides 7b (tests/scripts runs it at SHAPE=tiny), WORK /tmp/gpu_speed,
#                                  RUNS the placements (default cpu hybrid hybrid02; gpu4 gpu8 gpu8-ffn-only too);
#                                  hybrid is 0.4 GiB at 4 layers (about three quarters of the file), hybrid02 half
#                                  of it; then scripts/gpu_peers.py where PowerInfer's main was built
#                                  (PI_POWERINFER_MAIN overrides $PEER_DIR/build/bin/main): at both budgets ours
#                                  and PowerInfer's CUDA build on the same file and index, its -ngl layer offload
#                                  of the dense file, ours on the CPU alone (PEER_ROUNDS rounds, default 1), all
#                                  into $OUT/speed.txt as each row finishes
#   scripts/gpu_check.sh moe       (after build) a mixture's decode with experts on the device: the Qwen3-30B-A3B
#                                  shape (synthetic_llama.py; MOE_LAYERS layers, default 4 of 48) converted to q4_0,
#                                  profiled (256 tokens), then scripts/gpu_moe.py: `pi-tools plan --vram-budget
#                                  --memory-budget` at budgets holding a quarter, half and all of its experts beside
#                                  the device's head, and prompt and decode tokens/s on the CPU alone and with each
#                                  plan's experts on the device, the device's pairs and time a token ($OUT/moe.txt,
#                                  $OUT/moe.jsonl); WORK /tmp/gpu_moe, MOE_SHAPE (tests/scripts runs it here on
#                                  the emulated device at tiny-moe). Not part of `all` (its 10 minutes are spent):
#                                  run(command="scripts/gpu_check.sh build && scripts/gpu_check.sh moe", carry=[".gpu"])
#   scripts/gpu_check.sh sparsify  on the device machine: `pi-tools sparsify --device cuda` on a random-weight SiLU
#                                  Llama of 1.2B parameters (the 2b shape; its speed does not depend on the weights),
#                                  both phases' tokens/s, peak GPU memory, hours for 1B end-to-end tokens
#                                  ($OUT/sparsify.txt); SHAPE and DEVICE override 2b and cuda (SHAPE=tiny DEVICE=cpu
#                                  tries the command here)
#
# The device tool runs one command of at most 10 minutes:
#   run(command="scripts/gpu_check.sh all", carry=[".gpu"], timeout_s=600)
# Here, with the emulated device in place of CUDA and a smaller model, `speed` times its steps (tests/scripts does,
# at SHAPE=tiny):
#   PI_GPU_LIBRARY=$(ls engine/_pi_device_emulated*.so) PI_EMULATED_DEVICE_MIB=4096 LAYERS=1 THREADS=2 \
#       scripts/gpu_check.sh speed
set -euo pipefail
cd "$(dirname "$0")/.."
what="${1:-}"
OUT="${OUT:-build/gpu_check}"
GPU_DIR="${GPU_DIR:-.gpu}"
PEER_DIR="${PEER_DIR:-/tmp/powerinfer}"
mkdir -p "$OUT"

setup_device_machine() {
    # the wheels carried in .gpu/whl, the calibration text where the scripts look for it
    # once a machine: a step running beside another (the peer's build) keeps the files it runs from
    if ls .gpu/whl/*.whl >/dev/null 2>&1; then
        local site="${TMPDIR:-/tmp}/site"
        if [ ! -f "$site/.gpu-wheels" ]; then
            python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
                .gpu/whl/*.whl && touch "$site/.gpu-wheels"
        fi
        export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" PATH="$PATH:$site/bin"  # cmake's, after the system's
    fi
    if [ -d .gpu/data ] && [ ! -d ../shared/data ]; then mkdir -p ../shared && cp -r .gpu/data ../shared/data; fi
    # the binding is imported as powerinfer_engine (an install maps engine/ to that name; this checkout is not
    # installed there)
    local path_dir="${TMPDIR:-/tmp}/pi_path"
    mkdir -p "$path_dir" && ln -sfn "$PWD/engine" "$path_dir/powerinfer_engine"
    export PYTHONPATH="$path_dir:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
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
    if [ -n "${PI_POWERINFER_SRC:-}" ]; then  # the peer's build wants cmake, which the device image may lack
        "$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
            --platform manylinux2014_x86_64 -d .gpu/whl cmake
    fi
    "$0" prepare-peer
    du -sh .gpu
    ;;
prepare-peer)
    if [ -z "${PI_POWERINFER_SRC:-}" ]; then
        echo "PI_POWERINFER_SRC is unset: no peer source packed (speed's PowerInfer rows will be missing)"
        exit 0
    fi
    [ -f "$PI_POWERINFER_SRC/CMakeLists.txt" ] || { echo "$PI_POWERINFER_SRC: not a PowerInfer checkout (no CMakeLists.txt)"; exit 1; }
    mkdir -p "$GPU_DIR"
    tar -C "$PI_POWERINFER_SRC" --exclude=./models --exclude=./smallthinker --exclude=./.git --exclude=./build \
        -czf "$GPU_DIR/powerinfer-src.tar.gz.tmp" . && mv "$GPU_DIR/powerinfer-src.tar.gz.tmp" "$GPU_DIR/powerinfer-src.tar.gz"
    # its commit: the checkout's, or PI_POWERINFER_COMMIT for a source tree without .git
    (git -C "$PI_POWERINFER_SRC" rev-parse HEAD 2>/dev/null || echo "${PI_POWERINFER_COMMIT:-unknown}") \
        > "$GPU_DIR/powerinfer.commit"
    echo "peer source: $(cat "$GPU_DIR/powerinfer.commit"), $(du -h "$GPU_DIR/powerinfer-src.tar.gz" | cut -f1)"
    ;;
peer-build)
    [ -f "$GPU_DIR/powerinfer-src.tar.gz" ] || { echo "no $GPU_DIR/powerinfer-src.tar.gz (prepare-peer)"; exit 1; }
    rm -rf "$PEER_DIR" && mkdir -p "$PEER_DIR"
    tar -C "$PEER_DIR" -xzf "$GPU_DIR/powerinfer-src.tar.gz"
    arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d . || true)
    { cmake -S "$PEER_DIR" -B "$PEER_DIR/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CUBLAS=ON \
          -DCMAKE_CUDA_ARCHITECTURES="${arch:-90}" \
      && cmake --build "$PEER_DIR/build" --target main -j "${PEER_JOBS:-8}"; } > "$OUT/peer-build.log" 2>&1 \
        || { tail -30 "$OUT/peer-build.log"; exit 1; }
    ;;
build)
    setup_device_machine
    # sm_90 alone: the H200 this project is lent; PI_CUDA_ARCHS overrides
    PI_CUDA=1 PI_CUDA_ARCHS="${PI_CUDA_ARCHS:-90}" python3 setup.py build_ext --inplace -j "$(nproc)" > "$OUT/build.log" 2>&1 \
        || { tail -50 "$OUT/build.log"; exit 1; }
    ;;
smoke)
    setup_device_machine
    smoke=(python3 -X faulthandler -m pytest -x -q -p no:cacheprovider -m gpu -k cuda
           tests/engine/test_device_library_boundary.py tests/engine/test_engine_device_split.py
           "tests/engine/test_engine_device.py::test_the_device_tier_gives_the_cpu_logits[cuda-llama-relu-f32-attention]"
           "tests/engine/test_engine_device.py::test_greedy_tokens_agree_over_64_steps[cuda-llama-relu-q8_0]"
           "tests/engine/test_engine_device.py::test_greedy_tokens_agree_over_64_steps[cuda-llama-relu-q4_0]"
           tests/engine/test_device_experts_boundary.py)
    rc=0
    "${smoke[@]}" > "$OUT/smoke.log" 2>&1 || rc=$?
    tail -5 "$OUT/smoke.log"
    if [ "$rc" -ge 128 ] && command -v cuda-gdb >/dev/null; then  # killed by a signal: where
        timeout 120 cuda-gdb -batch -ex run -ex bt -ex "info threads" --args "${smoke[@]}" > "$OUT/backtrace.txt" 2>&1 || true
        grep -A30 "received signal" "$OUT/backtrace.txt" | head -60
    fi
    exit "$rc"
    ;;
tests)
    setup_device_machine
    # the CUDA library's tests (the emulation's run in CI)
    python3 -m pytest -q -p no:cacheprovider -rs -m gpu tests/engine/test_engine_device.py \
        tests/engine/test_engine_device_attention.py tests/engine/test_device_library_boundary.py \
        tests/engine/test_engine_device_split.py \
        tests/engine/test_device_experts_boundary.py tests/arch/test_moe_device.py \
        tests/profile/test_profile_layers.py::test_layer_by_layer_on_cuda_equals_the_whole_model_there \
        2>&1 | tee "$OUT/tests.log"
    # the gpu tests must have run, not been skipped for want of a device
    ! grep -q "SKIPPED.*\(no CUDA device\|no CUDA library\)" "$OUT/tests.log"
    ;;
all)
    start=$(date +%s)
    log() { echo "[$(( $(date +%s) - start )) s] $*" | tee -a "$OUT/progress.txt"; }
    : > "$OUT/progress.txt"
    setup_device_machine > /dev/null  # the wheels (cmake's among them) in place before the peer's build starts
    if [ -f "$GPU_DIR/powerinfer-src.tar.gz" ]; then  # the peer's build beside ours, its own log
        log "peer-build started ($(cat "$GPU_DIR/powerinfer.commit" 2>/dev/null))"
        ( if timeout 400 "$0" peer-build > "$OUT/peer-build.out" 2>&1; then log "peer-build done"
          else log "peer-build failed or cut short: $(tail -1 "$OUT/peer-build.out")"; fi ) &
    else
        log "no peer source in $GPU_DIR (prepare-peer): no PowerInfer rows"
    fi
    log "build"
    if timeout 150 "$0" build; then log "build done"; else log "build failed or cut short (rc $?)"; exit 1; fi
    log "smoke"
    rc=0
    timeout 60 "$0" smoke || rc=$?
    log "smoke (rc $rc): $(tail -1 "$OUT/smoke.log")"
    # a crash or a hang stops the run; a failed check leaves the rest worth measuring
    if [ "$rc" -ge 124 ]; then log "smoke crashed or hung: stopping here"; exit 1; fi
    log "tests"
    if timeout 150 "$0" tests > "$OUT/tests.out" 2>&1; then log "tests: $(tail -1 "$OUT/tests.log")"
    else log "tests FAILED or cut short (rc $?): $(tail -1 "$OUT/tests.log" 2>/dev/null || true)"; fi
    left=$(( ${ALL_SECONDS:-570} - ($(date +%s) - start) ))
    log "speed, $left s left"
    if PEER_WAIT=$(( left / 2 )) timeout "$left" "$0" speed > "$OUT/speed.out" 2>&1; then log "speed done"; else log "speed cut short or failed (rc $?)"; fi
    cat "$OUT/speed-steps.txt" "$OUT/speed.txt" 2>/dev/null | tee -a "$OUT/progress.txt" || true
    ;;
speed)
    setup_device_machine
    W="${WORK:-/tmp/gpu_speed}"
    layers="${LAYERS:-4}"
    shape="${SHAPE:-7b}"
    mkdir -p "$W"
    t0=$(date +%s)
    m="$W/relu$shape-$layers" prof="$W/prof-$shape-$layers" pred="$W/pred-$shape-$layers"
    [ -f "$m/config.json" ] || python3 scripts/synthetic_llama.py model --shape "$shape" --layers "$layers" --out "$m"
    [ -d "$prof" ] || python3 scripts/synthetic_llama.py profile --shape "$shape" --layers "$layers" --out "$prof"
    [ -d "$pred" ] || python3 scripts/synthetic_llama.py predictors --shape "$shape" --layers "$layers" --sparsity 0.9 \
        --out "$pred"
    echo "model, profile and predictors: $(( $(date +%s) - t0 )) s" | tee "$OUT/speed-steps.txt"
    # the 7B's budgets for the layers built: plan's reserve and the output head (a third of a GiB at the 7B's
    # q4_0) whole, the rest scaled by layers/32
    b4=$(python3 -c "print(round(0.33 + (4 - 0.33) * $layers / 32, 3))")
    b8=$(python3 -c "print(round(0.33 + (8 - 0.33) * $layers / 32, 3))")
    common=(bench -m "$m" --outtype q4_0 --predictors "$pred" --profile "$prof" --modes "${MODES:-predictor}"
            --peers '' --repeats "${REPEATS:-1}" --n-prompt 64 --n-gen 32 -t "${THREADS:-8}" --work-dir "$W/bench" -q)
    # a hybrid: at a few layers the 7B's scaled budgets hold the whole model; this one holds the head, attention and
    # KV caches and about half the hot rows (0.4 GiB at 4 layers), the rest of the FFN on the CPU
    bh=$(python3 -c "print(round(0.1 + 0.075 * $layers, 3))")
    bh2=$(python3 -c "print(round($bh / 2, 3))")  # a card much smaller than the model: about a third of the file
    runs="${RUNS:-cpu hybrid hybrid02}"
    for run in "cpu --gpu off" "hybrid --gpu on --vram-budget $bh" "hybrid02 --gpu on --vram-budget $bh2" \
               "gpu4 --gpu on --vram-budget $b4" "gpu8 --gpu on --vram-budget $b8" \
               "gpu8-ffn-only --gpu on --vram-budget $b8 --gpu-ffn-only"; do
        read -r name flags <<< "$run"
        [[ " $runs " == *" $name "* ]] || continue
        t0=$(date +%s)
        # a hybrid budget's index solved without the plan's default reserve (256 MiB, more than 0.2 GiB), at the
        # context the peers run at: the one gpu_peers.py hands PowerInfer too (once the bench's file is there)
        files=$(ls -d "$W"/bench/*/ 2>/dev/null | head -1 || true)
        if [[ $name == hybrid* ]] && [ -n "$files" ]; then
            python3 -m powerinfer_tools plan -m "$files/model.powerinfer.gguf" --vram-budget "${flags##* }" \
                --profile "$prof" --reserve-mib 0 --ctx-size 512 -o "$W/$name.gpuidx" > /dev/null
            flags="$flags --gpuidx $W/$name.gpuidx"
        fi
        # shellcheck disable=SC2086  # the flags split on purpose
        PI_CUDA_STEP_TIMES="$OUT/steps-$name.tsv" \
        python3 -m powerinfer_tools "${common[@]}" $flags --json-out "$OUT/bench-$name.json" --markdown "$OUT/bench-$name.md" \
            && echo "$name: $(( $(date +%s) - t0 )) s" | tee -a "$OUT/speed-steps.txt" \
            || echo "$name: FAILED after $(( $(date +%s) - t0 )) s" | tee -a "$OUT/speed-steps.txt"
        python3 scripts/gpu_speed_table.py "$OUT" "$layers" "$shape" > "$OUT/speed.txt"  # what is finished so far
    done
    # the peers: PowerInfer's CUDA build (waited for while `all` builds it) on the bench's own two files
    peer="${PI_POWERINFER_MAIN:-$PEER_DIR/build/bin/main}"
    for _ in $(seq "${PEER_WAIT:-0}"); do [ -x "$peer" ] && break; sleep 1; done
    files=$(ls -d "$W"/bench/*/ 2>/dev/null | head -1 || true)
    if [ -x "$peer" ] && [ -n "$files" ]; then
        t0=$(date +%s)
        python3 scripts/gpu_peers.py --file "$files/model.powerinfer.gguf" --dense "$files/model.llamacpp.gguf" \
            --powerinfer "$peer" --profile "$prof" --out "$OUT" --budgets "$bh,$bh2" --threads "${THREADS:-8}" \
            --rounds "${PEER_ROUNDS:-1}" > "$OUT/peers.log" 2>&1 \
            && echo "peers: $(( $(date +%s) - t0 )) s" | tee -a "$OUT/speed-steps.txt" \
            || echo "peers: FAILED after $(( $(date +%s) - t0 )) s: $(tail -1 "$OUT/peers.log")" | tee -a "$OUT/speed-steps.txt"
        python3 scripts/gpu_speed_table.py "$OUT" "$layers" "$shape" > "$OUT/speed.txt"
    else
        echo "peers: none ($peer not built)" | tee -a "$OUT/speed-steps.txt"
    fi
    cat "$OUT/speed.txt"
    ;;
moe)
    setup_device_machine
    W="${WORK:-/tmp/gpu_moe}"
    layers="${MOE_LAYERS:-4}"
    shape="${MOE_SHAPE:-qwen3-30b-a3b}"
    mkdir -p "$W"
    src="$W/$shape-$layers" m="$W/$shape-$layers.q4_0.gguf" prof="$W/prof-$shape-$layers"
    t0=$(date +%s)
    [ -f "$src/config.json" ] || python3 scripts/synthetic_llama.py model --shape "$shape" --layers "$layers" \
        --act silu --out "$src"
    [ -f "$m" ] || python3 -m powerinfer_tools convert -m "$src" -o "$m" --outtype q4_0 > "$OUT/moe-convert.log" 2>&1 \
        || { tail -20 "$OUT/moe-convert.log"; exit 1; }
    [ -d "$prof" ] || python3 -m powerinfer_tools profile -m "$m" --calib "${PI_DATA:-../shared/data}/wikitext-2-valid.txt" \
        --tokens 256 --seq-len 128 -t "${THREADS:-8}" -o "$prof" > "$OUT/moe-profile.log" 2>&1 \
        || { tail -20 "$OUT/moe-profile.log"; exit 1; }
    echo "model, file and profile: $(( $(date +%s) - t0 )) s" | tee "$OUT/moe.txt"
    python3 scripts/gpu_moe.py --model "$m" --profile "$prof" --threads "${THREADS:-8}" --out "$OUT" \
        | tee -a "$OUT/moe.txt"
    ;;
sparsify)
    setup_device_machine
    W=/tmp/gpu_sparsify
    shape="${SHAPE:-2b}"
    [ -f "$W/silu-$shape/config.json" ] || python3 scripts/synthetic_llama.py model --shape "$shape" --act silu \
        --out "$W/silu-$shape"
    rm -rf "$W/relu"
    python3 -m powerinfer_tools sparsify -m "$W/silu-$shape" --calib "${PI_DATA:-../shared/data}/wikitext-2-valid.txt" \
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
    sed -n 2,67p "$0"
    exit 2
    ;;
esac
