"""`pi-tools bench --memory-limit GiB`: each engine alone in a memory cgroup of that size (cgroup.py), as on a machine
with that much memory, the page cache dropped before each, so that what a token costs is what it reads from the disk.

Contestants, one process and one cgroup each, one after another (not interleaved: each starts cold):
  llama.cpp, its weights repacked into anonymous memory (its default on this CPU), and mapped only (repack off: its
  weights are the file's pages, which the kernel can drop and read again);
  ours in each FFN mode at its defaults (the engine's disk tier turns itself on where the FFN does not fit the limit
  less what the process holds, and its budget is that room: docs/engine.md, "Models larger than memory"; a mixture
  of experts' expert tier likewise, and a row with its lookahead on), and with --memory-budget's tier where one is
  given.
Per row: pp and tg speeds (medians over the rounds; the first round starts from an empty page cache), the cgroup's
peak (page cache included) and OOM kills, the storage bytes and major faults of a generated token (the kernel's
counts, /proc/PID/io: the same measure for every engine) and, where our engine's stats have a "disk" object, the
disk tier's own counters per token.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass

from powerinfer_tools.bench import cgroup
from powerinfer_tools.bench.runners import Worker, WorkerDied
from powerinfer_tools.core.errors import UserError
from powerinfer_tools.core.progress import progress_bar

@dataclass
class Contestant:
    label: str
    backend: str            # "ours" or "llama.cpp"
    mode: str               # our FFN mode; "dense" for llama.cpp
    options: dict           # the worker's engine options


def contestants(modes, ours_options: dict, budget_gib: float | None, llamacpp: bool,
                experts: bool = False) -> list[Contestant]:
    """The rows, in the order they run; ours with a given disk-tier budget only where budget_gib is given; for a
    mixture of experts (experts), ours also with the expert tier's lookahead (off by default), to show its worth."""
    rows = []
    if llamacpp:
        rows += [Contestant("llama.cpp repacked", "llama.cpp", "dense", {"repack": True}),
                 Contestant("llama.cpp mmap only", "llama.cpp", "dense", {"repack": False})]
    for mode in modes:
        rows.append(Contestant(f"ours {mode}", "ours", mode, dict(ours_options)))
        if experts:
            rows.append(Contestant(f"ours {mode} + lookahead", "ours", mode,
                                   dict(ours_options, expert_lookahead=True)))
        if budget_gib is not None:
            rows.append(Contestant(f"ours {mode} + disk tier", "ours", mode,
                                   dict(ours_options, memory_budget=budget_gib)))
    return rows


def disk_per_token(stats: dict | None) -> dict | None:
    """The disk tier's counters (stats()["disk"]: tokens, bytes, reads, cache_hits, cache_misses, io_wait_seconds,
    resident_bytes, budget_bytes) per generated token: bytes and reads from the file, the share of row lookups its
    cache served, and seconds waited on reads; for the expert tier (kind "experts": lookups are experts), the share of
    the experts its lookahead read ahead that a step then used, and with a tier plan the share of lookups its pinned
    experts served (among the hits); None where the stats have no disk object or it counted no token."""
    disk = (stats or {}).get("disk")
    if not disk or not disk.get("tokens"):
        return None
    n = disk["tokens"]
    lookups = disk["cache_hits"] + disk["cache_misses"]
    return {"bytes": disk["bytes"] / n, "reads": disk["reads"] / n,
            "hit_rate": disk["cache_hits"] / lookups if lookups else None,
            "io_wait_seconds": disk["io_wait_seconds"] / n,
            "resident_bytes": disk["resident_bytes"], "budget_bytes": disk["budget_bytes"],
            "prefetch_hit_rate": disk["prefetch_used"] / disk["prefetched"] if disk.get("prefetched") else None,
            "pinned_hit_rate": disk["pinned_hits"] / lookups if disk.get("tier_plan") and lookups else None}


def _speeds(tokens: int, replies: list[dict]) -> dict:
    tps = [tokens / r["wall"] for r in replies]
    return {"tokens": tokens, "seconds": [r["wall"] for r in replies], "tps": tps, "median": statistics.median(tps),
            "read_bytes": statistics.median(r.get("read_bytes", 0) / tokens for r in replies),
            "major_faults": statistics.median(r.get("major_faults", 0) / tokens for r in replies)}


def _measure(c: Contestant, group: cgroup.MemoryCgroup, start, prompt: list[int], tg: dict, rounds: int) -> dict:
    """One contestant's rounds in `group`; a worker killed or refused ends its row with the reason."""
    row = {"label": c.label, "backend": c.backend, "mode": c.mode, "disk_tier": "memory_budget" in c.options,
           "status": "ok"}
    worker = None
    try:
        worker = start(c, group)
        pp, gen = [], []
        for _ in range(rounds):
            if c.backend == "ours":
                worker.ask(op="mode", mode=c.mode)
            pp.append(worker.ask(op="pp", tokens=prompt))
            gen.append(worker.ask(op="tg", **tg))
        row["pp"], row["tg"] = _speeds(len(prompt), pp), _speeds(len(tg["tokens"]), gen)
        if c.backend == "ours":
            row["disk"] = disk_per_token(worker.ask(op="stats"))
        info = worker.ask(op="info")
        row["peak_rss_bytes"] = info.get("peak_rss_bytes")
        row["rss_before_model_bytes"] = info.get("rss_before_model_bytes")
        row["isa"] = info.get("isa")
    except WorkerDied as exc:
        row["status"] = "OOM-killed" if group.oom_kills() or exc.signal == "SIGKILL" else "died"
        row["message"] = str(exc)
    except UserError as exc:  # the engine refused to open (its memory check) or a request failed
        row["status"], row["message"] = "refused", str(exc)
    finally:
        if worker is not None:
            worker.close()
    row["peak_bytes"] = group.peak_bytes()
    row["oom_kills"] = group.oom_kills()
    return row


def check_can_run() -> None:
    """Refuse in one line, before the files are built, where no memory cgroup can be made or no page cache dropped."""
    import os

    cgroup.find_hierarchy()
    if not os.access(cgroup.DROP_CACHES, os.W_OK):
        raise UserError(f"--memory-limit drops the page cache before each engine: {cgroup.DROP_CACHES} is not "
                        "writable (run as root)")


def run(rows: list[Contestant], limit_bytes: int, start, prompt: list[int], tg: dict, rounds: int,
        progress: bool = True) -> list[dict]:
    """Every row in a fresh cgroup of limit_bytes, the page cache dropped before each. `start(contestant, group)`
    starts its worker in the group. Refuses in one line, before any engine runs, where cgroups cannot be made
    or the page cache cannot be dropped."""
    hierarchy = cgroup.find_hierarchy()
    out = []
    for c in progress_bar(rows, desc="memory-limited", unit="engine", disable=not progress):
        cgroup.drop_page_cache()
        with cgroup.MemoryCgroup(limit_bytes, hierarchy) as group:
            out.append(_measure(c, group, start, prompt, tg, rounds))
    return out


def start_worker(opts, files, n_ctx: int):
    """start(contestant, group) for run(): the contestant's worker on its file, in the group."""
    def start(c: Contestant, group: cgroup.MemoryCgroup) -> Worker:
        if c.backend == "llama.cpp":
            env = {"OMP_WAIT_POLICY": opts.llamacpp_wait.upper()} if opts.llamacpp_wait else None
            return Worker("llama.cpp", files.llamacpp, opts.threads, n_ctx, python=opts.peer_python, env=env,
                          engine_options=c.options, cgroup=group)
        return Worker("ours", files.powerinfer, opts.threads, n_ctx, opts.batch, opts.kv_type,
                      engine_options=c.options, cgroup=group)
    return start


def _f(v, fmt):
    return "–" if v is None else fmt.format(v)


def render(record: dict) -> list[str]:
    """The memory-limited table; the disk tier's columns only where a row has its counters."""
    lim = record.get("memory_limit")
    if not lim:
        return []
    st = record["settings"]
    rows = lim["rows"]
    disk = any(r.get("disk") for r in rows)
    head = (f"| engine | status | pp{st['n_prompt']} t/s | tg{st['n_gen']} t/s | peak MiB (cgroup) | OOM kills | "
            "storage MiB/token | major faults/token |")
    rule = "|---|---|---:|---:|---:|---:|---:|---:|"
    if disk:
        head += (" disk tier MiB/token | reads/token | cache hit rate | prefetch hit rate | I/O wait ms/token | "
                 "resident / budget MiB |")
        rule += "---:|---:|---:|---:|---:|---:|"
    lines = ["", f"Under a {lim['limit_gib']:g} GiB memory cgroup (cgroup v{lim['cgroup_version']}), one engine at a "
                 f"time, the page cache dropped before each; {st['repeats']} rounds, medians (the first from an "
                 f"empty cache); file {lim['file_gib']:.2f} GiB (ours), {lim['peer_file_gib']:.2f} GiB (llama.cpp):",
             "", head, rule]
    for r in rows:
        pp, tg = r.get("pp") or {}, r.get("tg") or {}
        cells = [r["label"], r["status"], _f(pp.get("median"), "{:.2f}"), _f(tg.get("median"), "{:.2f}"),
                 _f(r["peak_bytes"] / 2**20 if r.get("peak_bytes") is not None else None, "{:.0f}"),
                 str(r.get("oom_kills", "–")),
                 _f(tg["read_bytes"] / 2**20 if "read_bytes" in tg else None, "{:.1f}"),
                 _f(tg.get("major_faults"), "{:.0f}")]
        if disk:
            d = r.get("disk") or {}
            cells += [_f(d["bytes"] / 2**20 if d else None, "{:.1f}"), _f(d.get("reads"), "{:.0f}"),
                      _f(d.get("hit_rate"), "{:.0%}") + ("" if d.get("pinned_hit_rate") is None
                                                         else f" ({d['pinned_hit_rate']:.0%} pinned)"),
                      _f(d.get("prefetch_hit_rate"), "{:.0%}"),
                      _f(d["io_wait_seconds"] * 1e3 if d else None, "{:.1f}"),
                      f"{d['resident_bytes'] / 2**20:.0f} / {d['budget_bytes'] / 2**20:.0f}" if d else "–"]
        lines.append("| " + " | ".join(cells) + " |")
    for r in rows:
        if r.get("message"):
            lines.append(f"\n{r['label']}: {r['message']}")
    return lines
