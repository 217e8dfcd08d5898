#!/usr/bin/env python3
"""`pi-tools serve` against `pi-tools run` on the same file and settings, side by side in paired rounds, then a
soak of concurrent streaming clients.

1. Decode tokens/s: run's own "eval time" line against a streaming client's (tokens after the first) / (seconds
   from the first to the last token), each round a fresh prompt for both (the server's cache cannot help); and the
   client's rate against the server's own engine timings of the same request (what HTTP and the stream cost).
2. Time to the first streamed token against run's prompt time plus one token's.
3. CLIENTS streaming clients for SOAK seconds: every answer complete and well-formed, the server's RSS sampled
   (first against last minute), then SIGTERM: the exit status and how long it took.

  python scripts/serve_bench.py -m smollm2.q8_0.powerinfer.gguf -t 2 --rounds 5 --clients 8 --soak 120
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai

TOPICS = ["the history of Rome", "how bread is made", "the life of bees", "the river Thames", "a lighthouse keeper",
          "the first railways", "volcanoes", "a chess tournament", "the moon landing", "winter in Norway"]


def run_once(model: str, prompt: str, n: int, args) -> dict:
    cmd = [sys.executable, "-m", "powerinfer_tools", "run", "-m", model, "-p", prompt, "-n", str(n), "--temp", "0",
           "--repeat-penalty", "1", "-t", str(args.threads), "--sparse-mode", args.sparse_mode, "-c", str(args.ctx), "-v"]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    def ms(label):
        m = re.search(rf"{label} time =\s+([\d.]+) ms /\s+(\d+)", done.stderr)
        return float(m.group(1)), int(m.group(2))
    prompt_ms, prompt_n = ms("prompt eval")
    eval_ms, eval_n = ms(" eval")
    return {"prompt_ms": prompt_ms, "prompt_n": prompt_n, "eval_ms": eval_ms, "eval_n": eval_n,
            "decode_tps": eval_n / eval_ms * 1000}


def stream_once(client: openai.OpenAI, prompt: str, n: int) -> dict:
    sent = time.perf_counter()
    stamps, text, finish, engine_tps = [], "", None, None
    for chunk in client.completions.create(model="m", prompt=prompt, max_tokens=n, temperature=0, stream=True):
        choice = chunk.choices[0]
        if choice.text:
            stamps.append(time.perf_counter())
            text += choice.text
        finish = choice.finish_reason or finish
        if (chunk.model_extra or {}).get("timings"):
            engine_tps = chunk.model_extra["timings"]["predicted_per_second"]
    usage_n = n if finish == "length" else None
    # one chunk per token here (the default model's pieces are whole tokens but for rare UTF-8 splits)
    return {"ttft_ms": 1000 * (stamps[0] - sent), "decode_tps": (len(stamps) - 1) / (stamps[-1] - stamps[0]),
            "tokens": len(stamps), "finish": finish, "usage_n": usage_n, "engine_tps": engine_tps}


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(line for line in f if line.startswith("VmRSS")).split()[1])


def start_server(args) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "powerinfer_tools", "serve", "-m", args.model, "--port", "0", "-t",
                             str(args.threads), "--sparse-mode", args.sparse_mode, "-c", str(args.ctx)],
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    for line in proc.stderr:
        if "listening on" in line:
            url = re.search(r"http://[\d.]+:\d+", line).group(0)
            threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
            return proc, url
    raise SystemExit("the server did not start")


def soak(client: openai.OpenAI, pid: int, clients: int, seconds: float) -> dict:
    stop_at = time.monotonic() + seconds
    rss, errors, answers = [], [], []

    def client_loop(i):
        k = 0
        while time.monotonic() < stop_at:
            k += 1
            topic = TOPICS[(i + k) % len(TOPICS)]
            messages = [{"role": "user", "content": f"Write two sentences about {topic}. ({i}.{k})"}]
            try:
                chunks = list(client.chat.completions.create(model="m", messages=messages, max_tokens=64,
                                                             temperature=0.7, stream=True))
                finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
                if finishes[-1] not in ("stop", "length") or any(finishes[:-1]):
                    errors.append(f"client {i}: malformed stream {finishes}")
                answers.append("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
            except Exception as exc:  # noqa: BLE001  (every failure is counted, whatever its kind)
                errors.append(f"client {i}: {type(exc).__name__}: {exc}")

    def sample():
        while time.monotonic() < stop_at:
            rss.append((time.monotonic(), rss_kib(pid)))
            time.sleep(2)

    threading.Thread(target=sample, daemon=True).start()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(client_loop, range(clients)))
    start = rss[0][0]
    first = [kib for t, kib in rss if t - start < seconds / 2]
    last = [kib for t, kib in rss if t - start >= seconds / 2]
    return {"answers": len(answers), "empty_answers": sum(1 for a in answers if not a), "errors": errors,
            "rss_mib_first_half_median": statistics.median(first) / 1024,
            "rss_mib_second_half_median": statistics.median(last) / 1024,
            "rss_mib_max": max(kib for _, kib in rss) / 1024}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--sparse-mode", default="dense")
    ap.add_argument("-c", "--ctx", type=int, default=1024)
    ap.add_argument("-n", "--n-gen", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--soak", type=float, default=120.0)
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()

    proc, url = start_server(args)
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
    rounds = []
    for r in range(args.rounds):
        prompt = f"Here is a long essay about {TOPICS[r % len(TOPICS)]}:"
        client.completions.create(model="m", prompt="Unrelated.", max_tokens=1)  # the cache holds none of prompt
        served = stream_once(client, prompt, args.n_gen)
        ran = run_once(args.model, prompt, args.n_gen, args)
        rounds.append({"run": ran, "serve": served})
        print(f"round {r}: decode run {ran['decode_tps']:.1f} t/s, serve {served['decode_tps']:.1f} t/s; first token "
              f"serve {served['ttft_ms']:.0f} ms, run prompt+1 {ran['prompt_ms'] + ran['eval_ms'] / ran['eval_n']:.0f} "
              "ms", file=sys.stderr)
    ratio = statistics.median(r["serve"]["decode_tps"] / r["run"]["decode_tps"] for r in rounds)
    # what HTTP and the event stream cost: the client's rate against the server's own engine timings, same request
    overhead = statistics.median(r["serve"]["decode_tps"] / r["serve"]["engine_tps"] for r in rounds)
    ttft = statistics.median(r["serve"]["ttft_ms"] / (r["run"]["prompt_ms"] + r["run"]["eval_ms"] / r["run"]["eval_n"])
                             for r in rounds)
    soaked = soak(client, proc.pid, args.clients, args.soak)
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(60)
    result = {"model": os.path.basename(args.model), "threads": args.threads, "sparse_mode": args.sparse_mode,
              "n_gen": args.n_gen, "rounds": rounds, "decode_ratio_median": ratio, "ttft_ratio_median": ttft,
              "client_over_engine_median": overhead,
              "soak": soaked | {"clients": args.clients, "seconds": args.soak},
              "sigterm": {"exit_status": code, "seconds": time.monotonic() - started}}
    print(f"| decode t/s serve / run (median of {args.rounds} paired rounds) | {ratio:.3f} |")
    print(f"| decode t/s at the client / the server's engine timings, same request (median) | {overhead:.3f} |")
    print(f"| first token: serve / (run's prompt + one token) | {ttft:.3f} |")
    print(f"| soak: {args.clients} clients x {args.soak:.0f} s | {soaked['answers']} answers, "
          f"{len(soaked['errors'])} errors, {soaked['empty_answers']} empty |")
    print(f"| server RSS, median of first / second half (max) | {soaked['rss_mib_first_half_median']:.1f} / "
          f"{soaked['rss_mib_second_half_median']:.1f} MiB ({soaked['rss_mib_max']:.1f}) |")
    print(f"| SIGTERM | exit {code} after {result['sigterm']['seconds']:.2f} s |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
