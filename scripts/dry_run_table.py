#!/usr/bin/env python
"""The docs/dry-run.md table: `pi-tools plan --dry-run` for the real sizes at each outtype and VRAM budget.

Each cell is one run of the command (in-process, through the CLI's entry point), with its JSON summary read back:
the GPU's share of FFN neurons and of activations (under the assumed power-law counts unless --profile is given).

    python scripts/dry_run_table.py [--models relullama-70b,...] [--outtypes q4_0,q8_0] [--budgets 8,12,24]
                                    [--predictor-rank N]
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from powerinfer_tools.cli import main as cli  # noqa: E402

MODELS = "relullama-70b,relufalcon-40b,opt-30b,bamboo-7b"


def run(args: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            cli(args)
            code = 0
        except SystemExit as exc:
            code = exc.code or 0
    return code, err.getvalue()


def cell(model: str, outtype: str, budget: str, extra: list[str], work: Path) -> tuple[str, dict | None]:
    out = work / f"{model}-{outtype}-{budget}.json"
    code, err = run(["plan", "--dry-run", "-m", model, "--outtype", outtype, "--vram-budget", budget, "-o", str(out), *extra])
    if code:
        fixed = re.search(r"below the fixed costs ([\d.]+ \w+)", err)
        if not fixed:
            raise SystemExit(f"{model} {outtype} {budget}: {err.strip()}")
        return f"no (fixed costs {fixed.group(1)})", None
    s = json.loads(out.read_text())
    share = s["gpu_neurons"] / s["neurons"]
    return f"{share:.0%} / {s['served_fraction']:.0%}", s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=MODELS)
    ap.add_argument("--outtypes", default="q4_0,q8_0")
    ap.add_argument("--budgets", default="8,12,24", help="GiB")
    ap.add_argument("--predictor-rank", default=None)
    args = ap.parse_args()
    extra = ["--predictor-rank", args.predictor_rank] if args.predictor_rank is not None else []
    budgets = args.budgets.split(",")
    print("| model | type | file | " + " | ".join(f"{b} GiB: neurons / activations on GPU" for b in budgets) + " |")
    print("|---|---|---|" + "---|" * len(budgets))
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models.split(","):
            for outtype in args.outtypes.split(","):
                cells = [cell(model, outtype, budget, extra, Path(tmp))[0] for budget in budgets]
                _, everything = cell(model, outtype, "100000", extra, Path(tmp))  # all-GPU: the file's size
                size = everything["dry_run"]["file_bytes"]
                print(f"| {model} | {outtype} | {size / 2**30:.1f} GiB | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
