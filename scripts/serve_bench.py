#!/usr/bin/env python3
"""`pi-tools serve` against `pi-tools run` on the same file and settings, side by side in paired rounds, then a
soak of concurrent streaming clients.

1. Decode tokens/s: run's own "eval time" line against a streaming client's (tokens after the first) / (seconds
   from the first to the last token), each round a fresh prompt for both (the server's cache cannot help); and the
   client's rate against the server's own engine timings of the same request (what HTTP and the stream cost).
2. Time to the first streamed token against run's prompt time plus one token's.
3. CLIENTS streaming clients for SOAK seconds: every answer complete and well-formed, the server's RSS sampled
   (first against last minute), then SIGTERM: the exit status and how long it took.

--scenario parallel (issue 68's targets for `serve --parallel`):
4. For each k in --concurrency, k streaming clients at once (greedy, N_GEN tokens each, distinct prompts) against
   `serve --parallel P` and against `serve --parallel 1` (requests one after another), in paired rounds: the
   aggregate decode tokens/s (all clients' tokens after their first, over the seconds from the first client's first
   token to the last client's last) and each client's own rate, as ratios against one client alone on the same
   server.
5. The prompt cache: two chats alternating, each with a system prompt of PREFIX tokens, on `--parallel 2`: time to
   the first token of each chat's second request against its first.

  python scripts/serve_bench.py -m smollm2.q8_0.powerinfer.gguf -t 2 --rounds 5 --clients 8 --soak 120
  python scripts/serve_bench.py -m smollm2.q8_0.powerinfer.gguf -t 2 --scenario parallel --parallel 4 --rounds 3
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


def start_server(args, *extra: str) -> tuple[subprocess.Popen, str]:
    """`pi-tools serve` on a free port; the caller stops it (stop_server) whatever happens."""
    proc = subprocess.Popen([sys.executable, "-m", "powerinfer_tools", "serve", "-m", args.model, "--port", "0", "-t",
                             str(args.threads), "--sparse-mode", args.sparse_mode, "-c", str(args.ctx), *extra],
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    for line in proc.stderr:
        if "listening on" in line:
            url = re.search(r"http://[\d.]+:\d+", line).group(0)
            threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
            return proc, url
    proc.wait()
    raise SystemExit("the server did not start")


def stop_server(proc: subprocess.Popen) -> None:
    """Kills a server the run left running (a failed request, an interrupt): no `pi-tools serve` outlives the script."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def system_prompts(prefix: int) -> list[str]:
    """The two chats' system prompts of step 5, about `prefix` tokens each."""
    return [" ".join(f"{TOPICS[(i + j) % len(TOPICS)].split()[-1]} {j}" for j in range(prefix // 3)) for i in (0, 5)]


def check_prefix_fits(args) -> None:
    """Step 5's system prompts and their replies must fit the context: refused in one line before any server starts
    (else its requests would fail after the concurrency rounds)."""
    from powerinfer_tools.runtime import inference

    tokenizer = inference.load_tokenizer(inference.resolve_model_file(args.model).model)
    longest = max(len(tokenizer.encode(s)) for s in system_prompts(args.prefix))
    if longest + 64 > args.ctx:  # the chat template's tokens, the question and the reply
        raise SystemExit(f"serve_bench: --prefix {args.prefix} makes system prompts of {longest} tokens, which with "
                         f"their question and reply do not fit -c {args.ctx}: raise -c or lower --prefix")


def soak(client: openai.OpenAI, pid: int, clients: int, seconds: float) -> dict:
    stop_at = time.monotonic() + seconds
    rss, errors, answers = [], [], []
    every = min(2.0, seconds / 10)  # RSS samples: several in each half of a short soak too

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
            time.sleep(every)

    threading.Thread(target=sample, daemon=True).start()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(client_loop, range(clients)))
    rss.append((time.monotonic(), rss_kib(pid)))  # the end's, in the second half however short the soak
    start = rss[0][0]
    first = [kib for t, kib in rss if t - start < seconds / 2]
    last = [kib for t, kib in rss if t - start >= seconds / 2]
    return {"answers": len(answers), "empty_answers": sum(1 for a in answers if not a), "errors": errors,
            "rss_mib_first_half_median": statistics.median(first) / 1024,
            "rss_mib_second_half_median": statistics.median(last) / 1024,
            "rss_mib_max": max(kib for _, kib in rss) / 1024}


def together(client: openai.OpenAI, k: int, n: int, round_: int) -> dict:
    """k streaming clients started at once: the aggregate decode rate and each client's own (stream_once's)."""
    prompts = [f"Here is a long essay about {TOPICS[(round_ * 7 + i) % len(TOPICS)]} ({round_}.{i}):" for i in range(k)]
    starts, ends = [], []

    def one(prompt):
        sent = time.perf_counter()
        got = stream_once(client, prompt, n)
        first = sent + got["ttft_ms"] / 1000
        starts.append(first)
        ends.append(first + (got["tokens"] - 1) / got["decode_tps"])
        return got

    with ThreadPoolExecutor(k) as pool:
        each = list(pool.map(one, prompts))
    tokens = sum(g["tokens"] - 1 for g in each)
    return {"aggregate_tps": tokens / (max(ends) - min(starts)), "client_tps": [g["decode_tps"] for g in each]}


def parallel_scenario(args) -> dict:
    """Step 4 and 5 of the module's docstring; prints the tables' rows."""
    check_prefix_fits(args)
    result = {"concurrency": {}, "cache": None}
    for slots in (args.parallel, 1):
        proc, url = start_server(args, "--parallel", str(slots))
        try:
            client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
            client.completions.create(model="m", prompt="Warm up.", max_tokens=4)
            for k in args.concurrency:
                runs = [together(client, k, args.n_gen, r) for r in range(args.rounds)]
                result["concurrency"][f"{slots}:{k}"] = runs
            if slots == 2 or (slots == args.parallel and slots >= 2):
                result["cache"] = prompt_cache(client, args.prefix, args.rounds)
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
        finally:
            stop_server(proc)
    for slots in (args.parallel, 1):
        alone = statistics.median(r["aggregate_tps"] for r in result["concurrency"][f"{slots}:1"])
        for k in args.concurrency:
            runs = result["concurrency"][f"{slots}:{k}"]
            agg = statistics.median(r["aggregate_tps"] for r in runs)
            worst = statistics.median(min(r["client_tps"]) for r in runs)
            print(f"| --parallel {slots} | {k} | {agg:.1f} | {agg / alone:.2f}x | {worst:.1f} | {worst / alone:.2f}x |")
    c = result["cache"]
    print(f"| prompt cache, {c['prompt_tokens']}-token prompts, 2 chats alternating | first {c['first_ms']:.0f} ms | "
          f"repeat {c['repeat_ms']:.0f} ms | {c['repeat_ms'] / c['first_ms']:.3f}x | cached {c['cached_tokens']} |")
    return result


def prompt_cache(client: openai.OpenAI, prefix: int, rounds: int) -> dict:
    """Two chats with system prompts of about `prefix` tokens alternate: TTFT of each first request and of the
    repeats (medians), and the tokens the repeats reused."""
    systems = system_prompts(prefix)
    first, repeat, cached, prompt_tokens = [], [], [], 0

    def ask(system, question):
        sent, stamp, usage = time.perf_counter(), None, None
        for chunk in client.chat.completions.create(model="m", max_tokens=8, temperature=0, stream=True,
                                                    stream_options={"include_usage": True}, messages=[
                {"role": "system", "content": system}, {"role": "user", "content": question}]):
            if stamp is None and chunk.choices and chunk.choices[0].delta.content:
                stamp = time.perf_counter()
            usage = chunk.usage or usage
        # a reply with no text (the model's end at once): its first token is the end of its stream
        return 1000 * ((stamp or time.perf_counter()) - sent), usage

    for k in (0, 1):
        ms, usage = ask(systems[k], "Hello?")
        first.append(ms)
        prompt_tokens = usage.prompt_tokens
    for r in range(rounds):
        for k in (0, 1):
            ms, usage = ask(systems[k], f"Question {r}?")
            repeat.append(ms)
            cached.append(usage.prompt_tokens_details.cached_tokens)
    return {"prompt_tokens": prompt_tokens, "first_ms": statistics.median(first), "repeat_ms": statistics.median(repeat),
            "cached_tokens": min(cached)}


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
    ap.add_argument("--scenario", choices=("serve", "parallel"), default="serve",
                    help="serve: steps 1-3 (default); parallel: steps 4-5")
    ap.add_argument("--parallel", type=int, default=4, help="parallel: the slots of the server under test")
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4],
                    help="parallel: the client counts, comma-separated (1 first: the baseline)")
    ap.add_argument("--prefix", type=int, default=2000, help="parallel: the system prompts' tokens (about)")
    args = ap.parse_args()
    if args.scenario == "parallel":
        result = parallel_scenario(args)
    else:
        proc, url = start_server(args)
        try:
            result = serve_scenario(args, proc, url)
        finally:
            stop_server(proc)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


def serve_scenario(args, proc: subprocess.Popen, url: str) -> dict:
    """Steps 1-3 of the module's docstring against the started server, ending with its SIGTERM; prints the table."""
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
    return result


if __name__ == "__main__":
    main()
