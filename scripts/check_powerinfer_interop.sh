#!/usr/bin/env bash
# Interop with PowerInfer's own engine, both ways (docs/formats.md, "Checked against PowerInfer's binaries").
# A peer check: never needed by the tests or CI.
#   scripts/check_powerinfer_interop.sh POWERINFER_BUILD_DIR --work DIR [options: --help]
# POWERINFER_BUILD_DIR holds bin/main, bin/perplexity, bin/quantize and bin/gguf of a CPU build of PowerInfer's
# source (its parent is taken as that source: its converters and powerinfer-py). PowerInfer's solver needs cvxopt:
# give a PYTHONPATH entry holding it with PI_SOLVER_PATH or --solver-path.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
python="${PYTHON:-python3}"
[ -x "$here/../.venv/bin/python" ] && python="${PYTHON:-$here/../.venv/bin/python}"
exec "$python" "$here/check_powerinfer_interop.py" "$@"
