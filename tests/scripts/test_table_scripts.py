"""The scripts whose output is a table in the docs, arithmetic on the bundled configs' sizes or a seeded solver run:
run as documented (one model, one size), each row they print is checked, and where the docs quote the row, the docs
are checked against it (a row that no longer comes out of its script is a stale table)."""
from __future__ import annotations

import re

from script_helpers import ROOT, run_script, table_rows


def test_disk_read_table_gives_the_rows_docs_bench_quotes():
    out = run_script("disk_read_table.py", "--models", "relullama-7b,relullama-70b", "--memory", "16,20")
    rows = [line for line in out.splitlines() if line.startswith("| relullama")]
    assert len(rows) == 4, out
    bench = (ROOT / "docs" / "bench.md").read_text().splitlines()
    for row in rows:
        assert row in bench, row
    seventy = table_rows(out)[-1]
    assert seventy[:3] == ["relullama-70b", "37.2", "20"] and seventy[8] == "276"  # MiB a token from the disk


def test_dry_run_table_runs_plan_dry_run_per_cell():
    out = run_script("dry_run_table.py", "--models", "relullama-70b,bamboo-7b", "--outtypes", "q4_0",
                     "--budgets", "8,24")
    rows = {(r[0], r[1]): r for r in table_rows(out)}
    assert set(rows) == {("relullama-70b", "q4_0"), ("bamboo-7b", "q4_0")}, out
    cell = re.compile(r"^(\d+% / \d+%|no \(fixed costs [\d.]+ GiB\))$")
    for row in rows.values():
        assert re.fullmatch(r"[\d.]+ GiB", row[2]) and all(cell.match(c) for c in row[3:]) and len(row) == 5, row
    assert rows[("bamboo-7b", "q4_0")][3:] == ["100% / 100%", "100% / 100%"]  # a 7B fits 8 GiB whole
    assert rows[("relullama-70b", "q4_0")][3].startswith("no (fixed costs")  # a 70B's attention alone does not
    # docs/dry-run.md quotes the whole table (budgets 8, 12 and 24): its cells for these budgets are the script's
    documented: dict = {}
    for r in table_rows((ROOT / "docs" / "dry-run.md").read_text()):  # the first table: predictors at the cap
        documented.setdefault((r[0], r[1]), r)
    for key, row in rows.items():
        assert documented[key][2:4] + documented[key][5:6] == row[2:], (documented[key], row)


def test_bench_placement_gives_docs_placement_table():
    out = run_script("bench_placement.py", "--fractions", "0.25", "--models", "Llama-2-70B", "--time-limit", "5")
    served = {r[2]: (r[4], r[5]) for r in table_rows(out)}
    # docs/placement.md, Llama-2-70B at 25 %: ours and greedy 72.1005 %, PowerInfer's formulation 30,313 less
    assert served["milp"] == ("72.1005%", "+0") and served["greedy"] == ("72.1005%", "+0"), out
    assert served["powerinfer-256 (optimal)"] == ("72.0996%", "-30,313"), out
    placement = (ROOT / "docs" / "placement.md").read_text()
    assert "| Llama-2-70B | 25% (7.4 GiB) | ours (MILP) |" in placement and "| 72.0996% | -30,313 |" in placement
