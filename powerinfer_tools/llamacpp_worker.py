"""llama.cpp side of `pi-tools bench`, run as a script by any Python that has llama-cpp-python.

It imports nothing from powerinfer_tools, so it can run in a separate environment (--peer-python).
Run it with `python -I` (powerinfer_tools/ holds an inspect.py that would shadow the standard one).
Protocol: one JSON request per stdin line, one JSON reply per stdout line.
  {"op": "pp", "tokens": [...]}      -> {"seconds": s}   prompt of len(tokens) from an empty cache, one batch
  {"op": "tg", "tokens": [...]}      -> {"seconds": s}   one token at a time from an empty cache
  {"op": "argmax", "tokens": [...]}  -> {"argmax": [...]} greedy choice after each prefix (agreement check)
  {"op": "info"}                     -> versions, system info, peak RSS
Errors reply {"error": "..."}; the script exits at end of input.
"""
import json
import os
import resource
import sys
import time


def main() -> int:
    if len(sys.argv) != 4:
        print("usage: llamacpp_worker.py MODEL.gguf THREADS N_CTX", file=sys.stderr)
        return 2
    path, threads, n_ctx = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    try:
        import llama_cpp
        import numpy as np
    except ImportError as exc:
        print(json.dumps({"error": f"llama-cpp-python is not installed in {sys.executable} ({exc})"}), flush=True)
        return 1
    try:
        llm = llama_cpp.Llama(model_path=path, n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=min(n_ctx, 512),
                              n_threads=threads, n_threads_batch=threads, logits_all=False, use_mmap=True,
                              verbose=False)
    except Exception as exc:  # llama-cpp-python raises ValueError/RuntimeError on load failures
        print(json.dumps({"error": f"llama.cpp cannot load {path}: {exc}"}), flush=True)
        return 1
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        try:
            req = json.loads(line)
            op = req["op"]
            if op == "pp":
                llm.reset()
                start = time.perf_counter()
                llm.eval(req["tokens"])
                reply = {"seconds": time.perf_counter() - start}
            elif op == "tg":
                llm.reset()
                start = time.perf_counter()
                for token in req["tokens"]:
                    llm.eval([token])
                reply = {"seconds": time.perf_counter() - start}
            elif op == "argmax":
                llm.reset()
                choices = []
                for token in req["tokens"]:
                    llm.eval([token])  # keeps only the last token's logits (logits_all=False)
                    logits = np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(llm.n_vocab(),))
                    choices.append(int(logits.argmax()))
                reply = {"argmax": choices}
            elif op == "info":
                reply = {"llama_cpp_python": llama_cpp.__version__,
                         "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "default (active)"),
                         "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip(),
                         "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
            else:
                reply = {"error": f"unknown op {op!r}"}
        except Exception as exc:  # report and keep serving: the parent decides what to do
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(reply), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
