"""One contestant of `pi-tools bench` in its own process: our engine, llama.cpp or transformers.

Each contestant runs alone in a process so that its CPU time can be measured (time.process_time
covers all of the process's threads: work, spinning and all) and no other runtime's threads (torch's,
OpenBLAS's) share it. The llama.cpp backend imports nothing from powerinfer_tools, so this file can
run under another Python that has llama-cpp-python: `python -I worker.py llama.cpp ...` (-I:
powerinfer_tools/ holds an inspect.py that would shadow the standard one). Ours and torch run as
`python -m powerinfer_tools.bench.worker ours|torch ...`.

Protocol: one JSON request per stdin line, one JSON reply per stdout line.
  {"op": "pp", "tokens": [...]}      -> {"wall": s, "cpu": s}  prompt as one batch from an empty cache
  {"op": "tg", "tokens": [...], "context": [...]}
                                     -> {"wall": s, "cpu": s}  one token at a time after the context (not
                                        timed, optional) went into an empty cache
  {"op": "argmax", "tokens": [...]}  -> {"argmax": [...]}      greedy choice after each prefix
  {"op": "nll", "windows": [[...], ...]}
                                     -> {"nll": x, "tokens": n}  summed negative log-likelihood of every token
                                        but each window's first, each window from an empty cache
  {"op": "mode", "mode": "gate"}     -> {}                     (ours) FFN mode of the next requests
  {"op": "stats"}                    -> the engine's statistics of the last request, and the tokens cached (ours)
  {"op": "info"}                     -> versions, settings, peak RSS
Errors reply {"error": "..."}; the worker exits at end of input.
"""
import json
import os
import sys
import time


def _status_bytes(field: str = "VmHWM") -> int | None:
    """This process's peak (VmHWM) or current (VmRSS) resident set. Not ru_maxrss: Linux carries that over
    from the parent across fork + exec, so a worker would report the benchmark process's peak."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _token_nll(logits, token: int) -> float:
    """-log softmax(logits)[token] in float64. The runtime's window_nll computes the same for a whole window; the
    llama.cpp backend runs where powerinfer_tools cannot be imported, and every backend here uses this one."""
    import numpy as np

    z = np.asarray(logits, dtype=np.float64)
    top = z.max()
    return float(top + np.log(np.exp(z - top).sum()) - z[token])


def _window_nll(rows, ids) -> float:
    """Summed NLL of ids[1:] under `rows` (the logits after each of ids[:-1], in order)."""
    return sum(_token_nll(row, token) for row, token in zip(rows, ids[1:]))


def _io_counters() -> dict:
    """Bytes this process made the kernel read from storage (/proc/self/io read_bytes: its read() calls and its
    page faults on mapped files alike, page-cache hits not) and its major page faults (/proc/self/stat field 12):
    what any engine reads from the disk, whatever its own counters say. Zero where the kernel does not keep them."""
    out = {"read_bytes": 0, "major_faults": 0}
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    out["read_bytes"] = int(line.split()[1])
        with open("/proc/self/stat") as f:
            out["major_faults"] = int(f.read().rsplit(")", 1)[1].split()[9])
    except (OSError, ValueError, IndexError):
        pass
    return out


def _timed(fn) -> dict:
    io = _io_counters()
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    reply = {"wall": time.perf_counter() - wall, "cpu": time.process_time() - cpu}
    return dict(reply, **{k: v - io[k] for k, v in _io_counters().items()})


class LlamaCpp:
    """llama.cpp through llama-cpp-python. engine_options {"repack": false}: weights only mapped from the file
    (llama_model_params.use_extra_bufts off), not repacked into its CPU kernels' tiles in anonymous memory, which
    must fit in memory whole: what llama.cpp can run when the file is larger than memory."""

    def __init__(self, path: str, threads: int, n_ctx: int, engine_options: dict | None = None, **_):
        import llama_cpp
        import numpy as np

        self.np, self.llama_cpp = np, llama_cpp
        self.repack = (engine_options or {}).get("repack", True)
        if not self.repack:
            _without_extra_buffers(llama_cpp.llama_cpp)
        self.llm = llama_cpp.Llama(model_path=path, n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=min(n_ctx, 512),
                                   n_threads=threads, n_threads_batch=threads, logits_all=False, use_mmap=True,
                                   verbose=False)

    def pp(self, tokens):
        self.llm.reset()
        return _timed(lambda: self.llm.eval(tokens))

    def tg(self, tokens, context=()):
        self.llm.reset()
        if context:
            self.llm.eval(context)

        def run():
            for token in tokens:
                self.llm.eval([token])
        return _timed(run)

    def argmax(self, tokens):
        self.llm.reset()
        out = []
        for token in tokens:
            self.llm.eval([token])  # keeps only the last token's logits (logits_all=False)
            logits = self.np.ctypeslib.as_array(self.llm._ctx.get_logits_ith(-1), shape=(self.llm.n_vocab(),))
            out.append(int(logits.argmax()))
        return out

    def nll(self, windows):
        """One token at a time, as argmax: this Llama keeps only the last token's logits (logits_all=False)."""
        total, count = 0.0, 0
        for ids in windows:
            self.llm.reset()
            for i, token in enumerate(ids[:-1]):
                self.llm.eval([token])
                logits = self.np.ctypeslib.as_array(self.llm._ctx.get_logits_ith(-1), shape=(self.llm.n_vocab(),))
                total += _token_nll(logits, ids[i + 1])
            count += len(ids) - 1
        return {"nll": total, "tokens": count}

    def info(self):
        return {"llama_cpp_python": self.llama_cpp.__version__, "repack": self.repack,
                "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "default (active)"),
                "system_info": self.llama_cpp.llama_print_system_info().decode(errors="replace").strip()}


def _without_extra_buffers(low) -> None:
    """Make the model parameters Llama starts from (llama_model_default_params) have use_extra_bufts off: Llama has
    no keyword for it. Refused in one line by a llama-cpp-python whose llama.cpp predates the field."""
    default = low.llama_model_default_params
    if not hasattr(default(), "use_extra_bufts"):
        raise ValueError("this llama-cpp-python has no llama_model_params.use_extra_bufts: repacking cannot be "
                         "turned off")

    def params():
        p = default()
        p.use_extra_bufts = False
        return p
    low.llama_model_default_params = params


def mode_parts(mode: str) -> tuple[str, bool]:
    """(FFN mode, whether input sparsity is on) of a bench mode: input is dense mode with it, MODE+input that FFN
    mode with it (on attention's inputs: the engine's input-sparse FFN is dense mode's)."""
    if mode == "input":
        return "dense", True
    if mode.endswith("+input"):
        return mode[:-len("+input")], True
    return mode, False


class Ours:
    def __init__(self, path: str, threads: int, n_ctx: int, batch: int = 0, kv_type: str = "f32",
                 engine_options: dict | None = None, **_):
        import powerinfer_engine as engine

        self.rss_before_model = _status_bytes("VmRSS")  # the worker's Python and libraries, no weights yet
        options = dict(engine_options or {})
        self.input_share = options.pop("input_share", 0.0)  # the input mode's share
        self.model = engine.Model(path, threads=threads, sparse_mode="dense", ctx_size=n_ctx, batch_size=batch or None,
                                  kv_type=kv_type, **options)

    def mode(self, mode):
        """An FFN mode; input (dense mode with input sparsity at input_share) or MODE+input (that FFN mode with
        it); every other mode without it."""
        ffn, with_input = mode_parts(mode)
        self.model.sparse_mode = ffn
        if with_input or self.model.info["input_sparsity_levels"]:
            self.model.input_sparsity = self.input_share if with_input else 0.0

    def pp(self, tokens):
        self.model.reset()
        self.model.reset_stats()
        return _timed(lambda: self.model.eval(tokens, all_logits=False))

    def tg(self, tokens, context=()):
        self.model.reset()
        if context:
            self.model.eval(context, all_logits=False)
        self.model.reset_stats()

        def run():
            for token in tokens:
                self.model.eval([token], all_logits=False)
        return _timed(run)

    def argmax(self, tokens):
        self.model.reset()
        return [int(i) for i in self.model.eval(tokens, all_logits=True).argmax(axis=1)]

    def nll(self, windows):
        total, count = 0.0, 0
        for ids in windows:
            self.model.reset()
            total += _window_nll(self.model.eval(ids[:-1], all_logits=True), ids)
            count += len(ids) - 1
        return {"nll": total, "tokens": count}

    def stats(self):
        return dict(self.model.stats(), n_past=self.model.n_past)

    def info(self):
        return dict(self.model.info, rss_before_model_bytes=self.rss_before_model)


class Torch:
    def __init__(self, path: str, threads: int, **_):
        import inspect

        import torch

        from powerinfer_tools import models

        torch.set_num_threads(threads)
        self.torch = torch
        self.model = models.load_model(models.resolve(path))[0]
        # transformers 5 renamed past_key_values to cache; the cache object is updated in place
        self.cache_kw = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"

    def _step(self, ids, cache):
        self.model(input_ids=ids, use_cache=True, logits_to_keep=1, **{self.cache_kw: cache})

    def pp(self, tokens):
        from transformers import DynamicCache

        with self.torch.inference_mode():
            ids = self.torch.tensor([tokens])
            return _timed(lambda: self._step(ids, DynamicCache()))

    def tg(self, tokens, context=()):
        from transformers import DynamicCache

        cache = DynamicCache()

        def run():
            for token in tokens:
                self._step(self.torch.tensor([[token]]), cache)
        with self.torch.inference_mode():
            if context:
                self._step(self.torch.tensor([list(context)]), cache)
            return _timed(run)

    def nll(self, windows):
        total, count = 0.0, 0
        with self.torch.inference_mode():
            for ids in windows:
                logits = self.model(input_ids=self.torch.tensor([ids[:-1]])).logits[0].float().numpy()
                total += _window_nll(logits, ids)
                count += len(ids) - 1
        return {"nll": total, "tokens": count}

    def info(self):
        return {"torch": self.torch.__version__, "dtype": "float32"}


BACKENDS = {"llama.cpp": LlamaCpp, "ours": Ours, "torch": Torch}


def main() -> int:
    if len(sys.argv) < 5 or sys.argv[1] not in BACKENDS:
        print(f"usage: worker.py {{{','.join(BACKENDS)}}} MODEL THREADS N_CTX [BATCH [KV_TYPE [ENGINE_OPTIONS_JSON]]]",
              file=sys.stderr)
        return 2
    name, path, threads, n_ctx = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    batch = int(sys.argv[5]) if len(sys.argv) > 5 else 0
    kv_type = sys.argv[6] if len(sys.argv) > 6 else "f32"
    engine_options = json.loads(sys.argv[7]) if len(sys.argv) > 7 else None
    try:
        backend = BACKENDS[name](path, threads=threads, n_ctx=n_ctx, batch=batch, kv_type=kv_type,
                                 engine_options=engine_options)
    except ImportError as exc:
        print(json.dumps({"error": f"{name} is not installed in {sys.executable} ({exc})"}), flush=True)
        return 1
    except Exception as exc:  # each runtime raises its own types on load failures
        print(json.dumps({"error": f"{name} cannot load {path}: {exc}"}), flush=True)
        return 1
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        try:
            req = json.loads(line)
            op = req.pop("op")
            if op == "info":
                reply = dict(backend.info(), peak_rss_bytes=_status_bytes())
            elif not hasattr(backend, op):
                reply = {"error": f"{name} has no op {op!r}"}
            else:
                result = getattr(backend, op)(**req)
                reply = result if isinstance(result, dict) else {"result": result}
        except Exception as exc:  # report and keep serving: the parent decides what to do
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(reply), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
