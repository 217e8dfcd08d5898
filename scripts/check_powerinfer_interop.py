"""Files both ways between this toolkit and PowerInfer's engine, checked against PowerInfer's own binaries.

A peer check, never needed by the tests or CI: PowerInfer (SJTU-IPADS/PowerInfer) is built from its fetched
source in a temporary directory, and this script is given its build directory (bin/main, bin/perplexity,
bin/quantize, bin/gguf) and its source directory (its converters and powerinfer-py).

    scripts/check_powerinfer_interop.sh ../PowerInfer/build --work runs/interop

For each model (tiny random ReLU models of every architecture PowerInfer runs sparsely, built by the test
helpers, and an HF ReLU checkpoint given with --hf such as a `pi-tools sparsify` output):

- ours -> theirs: `pi-tools profile`, `train-predictor`, `convert` at each --types, with and without the gpu
  index `pi-tools plan` writes; PowerInfer's `main` greedy against ours greedy (dense, and predictor mode at
  PowerInfer's one predictor threshold) on the same prompt tokens; PowerInfer's `perplexity` against ours
  computed its way (llama.cpp's windows: BOS first, the second half of each window scored). And the default
  pipeline's files (train-predictor and convert with their defaults: a threshold a layer, which convert folds
  into fc2) at each type, greedy against ours; --default-pipeline-only runs these alone (bin/main only).
- theirs -> ours: PowerInfer's converter on the same HF model with our predictor directory, its `quantize`
  on that file, its solver (powerinfer-py) on our activation files; our engine on all of them.
- refusal: a SiLU llama converted by us must be refused by PowerInfer's loader.

Prints one table (artifact, producer, consumer, loads, tokens agree, perplexity ours vs theirs, note).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("PI_DATA", ROOT.parent / "shared" / "data"))  # text: PI_DATA, else ../shared/data
PROMPT = "The king said to his son"


# ---- running things ------------------------------------------------------------------------------

def run(cmd: list, log: Path, env: dict | None = None, check: bool = True, timeout: int = 3600):
    """Run `cmd` under nice, its output appended to `log`; the CompletedProcess."""
    cmd = ["nice", "-n", "19", *map(str, cmd)]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    with open(log, "a") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env,
                              timeout=timeout, errors="replace", cwd=log.parent)  # PowerInfer's main.log goes there
        f.write(proc.stdout + f"[rc={proc.returncode}]\n")
    if check and proc.returncode != 0:
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(cmd)}; see {log}")
    return proc


def pi_tools(*args, log: Path):
    return run([sys.executable, "-m", "powerinfer_tools", *args], log)


def tail(text: str, n: int = 1) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return " / ".join(lines[-n:])[:160]


@dataclass
class Generation:
    loads: bool
    prompt: list = field(default_factory=list)
    tokens: list = field(default_factory=list)
    error: str = ""
    logits: list = field(default_factory=list)  # ours: the logits each token was picked from


def yaml_ints(text: str, key: str) -> list:
    m = re.search(rf"^{key}: \[([^\]]*)\]", text, re.M)
    return [int(v) for v in m.group(1).split(",") if v.strip()] if m else []


class PowerInfer:
    """PowerInfer's binaries and tools, run as a user runs them (CPU build, one thread)."""

    def __init__(self, build: Path, source: Path, log: Path, solver_path: str, gguf_bin: Path | None,
                 numpy1_path: str):
        self.bin, self.source, self.log, self.solver_path = build / "bin", source, log, solver_path
        self.numpy1_path = numpy1_path  # its gguf-py calls numpy 1's ndarray.newbyteorder
        self.gguf_bin = gguf_bin or self.bin / "gguf"

    def main(self, model: Path, prompt: str | None, n: int, out: Path, prompt_file: Path | None = None,
             ctx: int = 256) -> Generation:
        logdir = out / "logdir"
        shutil.rmtree(logdir, ignore_errors=True)
        text = ["-f", prompt_file] if prompt_file else ["-p", prompt]
        proc = run([self.bin / "main", "-m", model, *text, "-n", n, "--temp", "0", "--repeat-penalty", "1.0",
                    "--ignore-eos", "-t", "1", "-c", ctx, "-s", "1", "--logdir", str(logdir) + "/"],
                   self.log, check=False)
        ymls = sorted(logdir.glob("*.yml")) if logdir.is_dir() else []
        if proc.returncode != 0 or not ymls:
            why = re.findall(r"^error loading model: .*$", proc.stdout, re.M)
            return Generation(False, error=why[-1] if why else tail(proc.stdout, 2))
        y = ymls[-1].read_text(errors="replace")
        return Generation(True, yaml_ints(y, "prompt_tokens"), yaml_ints(y, "output_tokens"))

    def perplexity(self, model: Path, text: Path, ctx: int, chunks: int) -> tuple[float | None, str]:
        proc = run([self.bin / "perplexity", "-m", model, "-f", text, "-c", ctx, "--chunks", chunks, "-t", "1",
                    "-b", ctx], self.log, check=False)
        m = re.search(r"Final estimate: PPL = ([0-9.]+)", proc.stdout)
        return (float(m.group(1)) if m else None), ("" if m else tail(proc.stdout, 2))

    def quantize(self, src: Path, dst: Path, qtype: str) -> tuple[bool, str]:
        proc = run([self.bin / "quantize", src, dst, qtype.upper(), "1"], self.log, check=False)
        return proc.returncode == 0 and dst.is_file(), tail(proc.stdout, 2)

    def parses(self, path: Path) -> tuple[list, str]:
        """Tensor names that PowerInfer's own GGUF parser (its examples/gguf) reads from `path`: that example's
        first pass lists the tensor table; its second pass checks data only its own writer makes, so its
        exit status says nothing here."""
        proc = run([self.gguf_bin, path, "r"], self.log, check=False)
        names = re.findall(r"gguf_ex_read_0: tensor\[\d+\]: name = (\S+), offset", proc.stdout)
        return names, tail(proc.stdout, 1)

    def convert(self, script: str, hf: Path, predictors: Path, out: Path, outtype: str,
                options: list) -> tuple[bool, str]:
        args = ["--outfile", out, "--outtype", outtype, *options, hf, predictors]
        proc = run([sys.executable, self.source / script, *args], self.log, env={"PYTHONPATH": self.numpy1_path},
                   check=False)
        # its convert-hf-to-powerinfer-gguf.py stops with status 0 on a tensor it cannot map (sys.exit())
        return proc.returncode == 0 and out.is_file() and out.stat().st_size > 0, tail(proc.stdout, 2)

    def solver(self, activation: Path, n_layer: int, n_ff: int, capacity: int, out: Path) -> tuple[bool, str]:
        paths = (self.solver_path, self.numpy1_path, str(self.source / "gguf-py"), str(self.source / "powerinfer-py"))
        env = {"PYTHONPATH": os.pathsep.join(p for p in paths if p)}
        proc = run([sys.executable, "-m", "powerinfer", "--activation", activation, "--layer", n_layer, "--neuron",
                    n_ff, "--capacity", capacity, "--vram-capacity", 1 << 20, "--output", out],
                   self.log, env=env, check=False)
        return proc.returncode == 0 and out.is_file(), tail(proc.stdout, 2)


# ---- our engine ----------------------------------------------------------------------------------

def ours_greedy(model: Path, prompt: list, n: int, mode: str, gpuidx: Path | None = None) -> Generation:
    """Greedy tokens after `prompt` as PowerInfer's main --ignore-eos --repeat-penalty 1 picks them (the
    end-of-sequence token never chosen). A gpuidx's neurons are a hot tier on the CPU, computed whole, as the
    results recorded in docs/formats.md were."""
    import powerinfer_engine as engine

    try:
        with engine.Model(model, threads=1, sparse_mode=mode, gpuidx=gpuidx, cpu_hot_tier=True, ctx_size=256) as m:
            eos = m.info["eos"]
            logits = m.eval(prompt, all_logits=False)
            out = []
            out, seen = [], []
            for _ in range(n):
                if eos is not None and eos >= 0:
                    logits[eos] = -np.inf
                out.append(int(np.argmax(logits)))
                seen.append(logits)
                logits = m.eval([out[-1]], all_logits=False)
            return Generation(True, list(prompt), out, logits=seen)
    except Exception as exc:  # noqa: BLE001  the table reports what failed to load
        return Generation(False, error=str(exc).splitlines()[0][:160])


def ours_perplexity(model: Path, tokens: list, ctx: int, chunks: int, bos: int | None, mode: str) -> float:
    """llama.cpp's perplexity (examples/perplexity): windows of ctx tokens, the first replaced by BOS for a
    SentencePiece vocabulary, the last ctx/2 - 1 next-token predictions of each window scored."""
    import powerinfer_engine as engine

    nll, count = 0.0, 0
    with engine.Model(model, threads=1, sparse_mode=mode, ctx_size=ctx) as m:
        for i in range(min(chunks, len(tokens) // ctx)):
            window = list(tokens[i * ctx:(i + 1) * ctx])
            if bos is not None:
                window[0] = bos
            m.reset()
            logits = m.eval(window).astype(np.float64)
            first = ctx // 2
            for j in range(first, ctx - 1):
                row = logits[j]
                lse = row.max() + np.log(np.exp(row - row.max()).sum())
                nll += lse - row[window[j + 1]]
                count += 1
    return float(np.exp(nll / count))


def gguf_info(path: Path) -> dict:
    import powerinfer_engine as engine

    with engine.Model(path, threads=1) as m:
        return m.info


# ---- the table -----------------------------------------------------------------------------------

ROWS: list[dict] = []


def row(artifact: str, producer: str, consumer: str, loads, tokens="", ppl="", note=""):
    ROWS.append(dict(artifact=artifact, producer=producer, consumer=consumer,
                     loads={True: "yes", False: "no"}.get(loads, loads), tokens=tokens, ppl=ppl, note=note))
    print(f"  {artifact} | {producer} -> {consumer} | {ROWS[-1]['loads']} | {tokens} | {ppl} | {note}", flush=True)


def agreement(theirs: Generation, ours: Generation) -> str:
    """Tokens in a row that agree; where they part, how far below our pick their token was in our logits
    (a gap within rounding of the weights' type is the quantization's, not the file's)."""
    if not (theirs.loads and ours.loads):
        return ""
    if theirs.prompt != ours.prompt:
        return "different prompts"
    same = 0
    for x, y in zip(theirs.tokens, ours.tokens):
        if x != y:
            break
        same += 1
    n = min(len(theirs.tokens), len(ours.tokens))
    if same == n:
        return f"{same}/{n}"
    row = ours.logits[same]
    gap = float(row[ours.tokens[same]] - row[theirs.tokens[same]])
    rank = int((row > row[theirs.tokens[same]]).sum()) + 1
    return f"{same}/{n}; at {same} theirs is our #{rank}, {gap:.3g} below (logit sd {float(np.std(row[np.isfinite(row)])):.3g})"


def print_table() -> str:
    head = ["artifact", "producer", "consumer", "loads", "tokens agree", "perplexity ours vs theirs", "note"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in ROWS:
        lines.append("| " + " | ".join(str(r[k]) for k in
                                       ("artifact", "producer", "consumer", "loads", "tokens", "ppl", "note")) + " |")
    return "\n".join(lines)


# ---- one model, both ways ------------------------------------------------------------------------

def with_uniform_threshold(pred: Path, out: Path) -> Path:
    """A copy of a predictor directory whose layers all use its `sparse_threshold`, the one value PowerInfer
    reads (llama.cpp: hparams.sparse_pred_threshold): both engines then compute the same neurons."""
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(pred, out)
    config = json.loads((out / "config.json").read_text())
    for layer in config["layers"]:
        layer["threshold"] = config["sparse_threshold"]
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def last_logits(model: Path, tokens: list, mode: str) -> np.ndarray:
    import powerinfer_engine as engine

    with engine.Model(model, threads=1, sparse_mode=mode, ctx_size=256) as m:
        return m.eval(tokens, all_logits=False)


def quantization_gap(theirs: Generation, ours: Generation, reference: Path, model: Path, mode: str) -> str:
    """Where PowerInfer and we part on a quantized file: how far apart the two picks are in our logits, next to
    how far quantization moves our logits there (ours on the file against ours on the unquantized one, same
    prefix).
    A gap below that is the quantization's, not the file's."""
    k = next((i for i, (a, b) in enumerate(zip(theirs.tokens, ours.tokens)) if a != b), None)
    if k is None:
        return ""
    prefix = theirs.prompt + theirs.tokens[:k]
    q, f = last_logits(model, prefix, mode), last_logits(reference, prefix, mode)
    a, b = ours.tokens[k], theirs.tokens[k]
    gap, moved = float(q[a] - q[b]), float(np.sqrt(np.mean((q - f) ** 2)))
    return (f"at {k}: gap {gap:.3g} {'<' if gap < moved else '>='} quantization's logit error {moved:.3g} "
            "(rms, against the unquantized file)")


def converted(f: Path, hf: Path, pred: Path, prof: Path, outtype: str, log: Path) -> Path:
    """`f`: `pi-tools convert` of `hf` with these predictors and profile, made once (kept for a rerun)."""
    if not f.is_file():
        pi_tools("convert", "-m", hf, "--predictors", pred, "--profile", prof, "--outtype", outtype, "-o", f, "-q",
                 log=log)
    return f


def ours_to_theirs(name: str, hf: Path, work: Path, pi: PowerInfer, args, prof: Path, pred: Path,
                   eval_text: Path) -> None:
    log = work / "log.txt"
    uniform = with_uniform_threshold(pred, work / "pred-uniform")
    for outtype in args.types:
        f = converted(work / f"{name}.{outtype}.powerinfer.gguf", hf, uniform, prof, outtype, log)
        theirs = pi.main(f, PROMPT, args.tokens, work)
        if not theirs.loads:
            row(f.name, "pi-tools convert", "PowerInfer main", False, note=theirs.error)
            continue
        ours = ours_greedy(f, theirs.prompt, args.tokens, "predictor")
        dense = ours_greedy(f, theirs.prompt, args.tokens, "dense")
        # with a gpu index (pi-tools plan), beside the model as PowerInfer looks for it
        idx = Path(str(f) + ".generated.gpuidx")
        pi_tools("plan", "-m", f, "--vram-budget", args.vram_budget, "--profile", prof, "--reserve-mib", "0",
                 "--min-layer-neurons", "0", "-o", idx, log=log)
        theirs_idx = pi.main(f, PROMPT, args.tokens, work)
        ours_idx = ours_greedy(f, theirs.prompt, args.tokens, "predictor", gpuidx=idx)
        if outtype == args.types[0]:
            names, msg = pi.parses(idx)
            n_layer = gguf_info(f)["n_layer"]
            want = [f"blk.{i}.{k}" for i in range(n_layer) for k in ("gpu_idx", "gpu_bucket")]
            row(f"{name} index (pi-tools plan)", "pi-tools plan", "PowerInfer's GGUF parser", names == want,
                note="the 2 tensors a layer its loader takes by position" if names == want else msg)
        idx.unlink()
        Path(str(idx) + ".json").unlink(missing_ok=True)
        ppl, note = "", []
        if outtype in args.ppl_types:
            text = eval_file(f, eval_text, work, int(1.2 * args.ctx * args.chunks))
            their_ppl, err = pi.perplexity(f, text, args.ctx, args.chunks)
            bos = bos_of_spm(f)
            # perplexity's tokens, through main: main tokenizes with special tokens parsed, and then puts no space
            # before a SentencePiece text, which perplexity does (llama.cpp llama_tokenize_internal)
            as_main = text if bos is None else work / "eval.main.txt"
            if bos is not None:
                as_main.write_text(" " + text.read_text())
            split = pi.main(f, None, 1, work, prompt_file=as_main, ctx=2048)
            if their_ppl is not None and split.loads:
                mine = ours_perplexity(f, split.prompt, args.ctx, args.chunks, bos, "predictor")
                ppl = f"{mine:.3f} vs {their_ppl:.3f} ({100 * (mine / their_ppl - 1):+.2f} %)"
                note.append(tokenization(f, text, split.prompt))
            else:
                ppl = f"theirs failed: {err or split.error}"
        note += [f"with the index {agreement(theirs_idx, ours_idx)}", f"ours dense {agreement(theirs, dense)}"]
        if outtype not in ("f32", "f16"):
            note.append(quantization_gap(theirs, ours, work / f"{name}.f32.powerinfer.gguf", f, "predictor"))
        row(f.name, "pi-tools convert", "PowerInfer main / ours predictor", True, agreement(theirs, ours), ppl,
            note="; ".join(n for n in note if n))
    default_pipeline(name, hf, work, pi, args, prof)


def default_pipeline(name: str, hf: Path, work: Path, pi: PowerInfer, args, prof: Path) -> None:
    """A file as the default pipeline writes it: train-predictor with its defaults (a threshold calibrated per
    layer), convert with its defaults (those thresholds folded into fc2, conversion.ThresholdFold), at each
    type; PowerInfer's greedy tokens against ours in predictor mode."""
    log = work / "log.txt"
    pred = work / "pred-default"
    if not (pred / "config.json").is_file():
        pi_tools("train-predictor", prof, "--out", pred, "--threads", 1, "--force", log=log)
    thresholds = [layer["threshold"] for layer in json.loads((pred / "config.json").read_text())["layers"]]
    for outtype in args.types:
        f = converted(work / f"{name}.{outtype}.default-pipeline.powerinfer.gguf", hf, pred, prof, outtype, log)
        g = pi.main(f, PROMPT, args.tokens, work)
        ours = ours_greedy(f, g.prompt, args.tokens, "predictor") if g.loads else Generation(False)
        note = [f"per-layer thresholds {min(thresholds):.3g} to {max(thresholds):.3g} folded into fc2"]
        if g.loads and ours.loads and outtype not in ("f32", "f16"):
            reference = work / f"{name}.f32.default-pipeline.powerinfer.gguf"
            if reference.is_file():
                note.append(quantization_gap(g, ours, reference, f, "predictor"))
        row(f.name, "pi-tools train-predictor + convert (defaults)", "PowerInfer main / ours predictor", g.loads,
            agreement(g, ours), note="; ".join(n for n in note if n) if g.loads else g.error)


def eval_file(model: Path, text: Path, work: Path, n_tokens: int) -> Path:
    """The first part of the evaluation text that holds about n_tokens tokens: PowerInfer's main then tokenizes
    it whole within its 2048 positions (OPT's limit), so both perplexities score its tokens."""
    from powerinfer_tools.formats.tokenizer import tokenizer_from_file

    out = work / "eval.txt"
    if not out.is_file():
        full = text.read_text()
        tok = tokenizer_from_file(model)
        chars = int(len(full) * min(1.0, n_tokens / len(tok.encode(full, add_special_tokens=False))))
        out.write_text(full[:chars])
    return out


def bos_of_spm(model: Path) -> int | None:
    """The BOS that llama.cpp's main and perplexity put first: a SentencePiece vocabulary's only."""
    from powerinfer_tools.formats.gguf_io import open_reader

    spm = open_reader(model).fields["tokenizer.ggml.model"].contents() == "llama"
    return gguf_info(model)["bos"] if spm else None


def tokenization(model: Path, text: Path, theirs: list) -> str:
    """Whether our tokenizer (rebuilt from the file's keys) splits the text as PowerInfer's does."""
    from powerinfer_tools.formats.tokenizer import tokenizer_from_file

    bos = bos_of_spm(model)
    ours = tokenizer_from_file(model).encode(text.read_text().rstrip("\n"), add_special_tokens=False)
    ours = ([bos] if bos is not None else []) + list(ours)
    k = next((i for i, (a, b) in enumerate(zip(theirs, ours)) if a != b), None)
    if k is None and len(theirs) == len(ours):
        return "tokenized alike"
    return f"tokenized apart from token {k} ({len(ours)} ours, {len(theirs)} theirs)"


def theirs_to_ours(name: str, hf: Path, work: Path, pi: PowerInfer, args, prof: Path, pred: Path,
                   eval_text: Path, scripts: list[str]) -> None:
    uniform = work / "pred-uniform"
    source, (hf, options) = hf, their_view(hf, work)
    for script in scripts:
        base = work / f"theirs.{Path(script).stem}.f16.gguf"
        base.unlink(missing_ok=True)  # its converters leave an empty file when they fail
        ok, msg = pi.convert(script, hf, uniform, base, "f16", options if script == "convert.py" else [])
        if not ok:
            row(base.name, f"PowerInfer {script}", "-", False, note=msg)
            continue
        files = [base]
        for qtype in args.their_quants:
            q = base.with_name(base.name.replace(".f16.", f".{qtype}."))
            q.unlink(missing_ok=True)
            ok, msg = pi.quantize(base, q, qtype)
            if ok:
                files.append(q)
            else:
                row(q.name, "PowerInfer quantize", "-", False, note=msg)
        for f in files:
            g = pi.main(f, PROMPT, args.tokens, work)
            prompt = g.prompt if g.loads else [1, 2, 3]
            ours = ours_greedy(f, prompt, args.tokens, "predictor")
            dense = ours_greedy(f, prompt, args.tokens, "dense")
            producer = f"PowerInfer {script}" + (" + quantize" if f is not base else "")
            note = [] if g.loads else [f"theirs: {g.error}"]
            if not ours.loads:
                note.append(f"ours: {ours.error}")
            elif g.loads:
                note.append(f"ours dense {agreement(g, dense)}")
                if f is base:
                    note.append(f"ours dense vs transformers: max rel err {against_transformers(source, f):.2g}")
                else:
                    note.append(quantization_gap(g, ours, base, f, "predictor"))
                    down = down_type(f)
                    if down not in ("F16", "Q4_0"):
                        note.append(f"its quantize made ffn_down_t {down}, which PowerInfer's CPU axpy reads as f16 "
                                    "(ggml.c ggml_compute_forward_mul_mat_axpy)")
            row(f.name, producer, "ours predictor / PowerInfer main", ours.loads and g.loads,
                agreement(g, ours), note="; ".join(n for n in note if n))


def against_transformers(hf: Path, model: Path) -> float:
    """How far our dense logits on `model` are from transformers' on the checkpoint it was converted from."""
    sys.path.insert(0, str(ROOT / "tests"))
    import powerinfer_engine as engine
    from engine_helpers import hf_logits, max_rel_err

    tokens = [int(t) for t in np.random.default_rng(0).integers(3, 300, 16)]
    with engine.Model(model, threads=1, sparse_mode="dense") as m:
        return float(max_rel_err(m.eval(tokens), hf_logits(hf, tokens)))


def down_type(path: Path) -> str:
    from powerinfer_tools.formats.gguf_io import open_reader

    t = next(t for t in open_reader(path).tensors if t.name == "blk.0.ffn_down_t.weight")
    return t.tensor_type.name


def their_view(hf: Path, work: Path) -> tuple[Path, list]:
    """The HF directory as PowerInfer's convert.py takes it, and the options it needs: a Bamboo by model_type
    "bamboo" (Params.loadHFTransformerJson), which transformers does not know; a top-level rope_theta, which
    transformers 5 writes under rope_parameters only (`pi-tools sparsify` writes both); a byte-level BPE
    vocabulary from vocab.json with --vocabtype bpe (BpeVocab), where the checkpoint has only tokenizer.json;
    its merges from merges.txt where tokenizer.json holds them as pairs, as tokenizers >= 0.20 writes them
    (its gguf-py vocab.py takes them from tokenizer.json only as "a b" strings); an OPT's tensors under the
    names of Meta's checkpoints (decoder.*: its gguf-py tensor_mapping.py), not transformers' model.decoder.*."""
    cfg = json.loads((hf / "config.json").read_text())
    changed, extra, options = dict(cfg), {}, []
    if cfg.get("architectures") == ["BambooForCausalLM"]:
        changed["model_type"] = "bamboo"
    if "rope_theta" not in cfg and "rope_theta" in (cfg.get("rope_parameters") or {}):
        changed["rope_theta"] = cfg["rope_parameters"]["rope_theta"]
    if not (hf / "tokenizer.model").is_file() and (hf / "tokenizer.json").is_file():
        options = ["--vocabtype", "bpe"]
        model = json.loads((hf / "tokenizer.json").read_text())["model"]
        if not (hf / "vocab.json").is_file():
            extra["vocab.json"] = json.dumps(model["vocab"])
        merges = model.get("merges") or []
        if merges and not isinstance(merges[0], str) and not (hf / "merges.txt").is_file():
            extra["merges.txt"] = "".join(f"{a} {b}\n" for a, b in merges)
    renamed = None
    if cfg.get("architectures") == ["OPTForCausalLM"]:
        from safetensors.torch import load_file

        renamed = {k.removeprefix("model."): v for k, v in load_file(hf / "model.safetensors").items()}
    if changed == cfg and not extra and renamed is None:
        return hf, options
    view = work / "hf-as-powerinfer-reads-it"
    shutil.rmtree(view, ignore_errors=True)
    view.mkdir()
    own = ("config.json", *extra, *(["model.safetensors"] if renamed is not None else []))
    for f in hf.iterdir():
        if f.name not in own and not (view / f.name).exists():
            (view / f.name).symlink_to(f.resolve())
    if renamed is not None:
        from safetensors.torch import save_file

        save_file(renamed, view / "model.safetensors")
    (view / "config.json").write_text(json.dumps(changed, indent=2))
    for name, text in extra.items():
        (view / name).write_text(text)
    return view, options


def solver_both_ways(name: str, hf: Path, work: Path, pi: PowerInfer, args, prof: Path) -> None:
    """PowerInfer's solver on our activation files, for a file in the source order (the order its solver
    counts neurons in)."""
    log = work / "log.txt"
    f = work / f"{name}.f16.source-order.powerinfer.gguf"
    if not f.is_file():
        pi_tools("convert", "-m", hf, "--predictors", work / "pred-uniform", "--outtype", "f16", "-o", f, "-q", log=log)
    info = gguf_info(f)
    n_layer, n_ff = info["n_layer"], info["n_ff"]
    idx = work / "theirs.solver.gpuidx"
    ok, msg = pi.solver(prof / "activation", n_layer, n_ff, n_ff * n_layer // 2, idx)
    if not ok:
        row(idx.name, "PowerInfer solver (powerinfer-py)", "ours", False, note=msg)
        return
    g = pi.main(f, PROMPT, args.tokens, work)
    ours = ours_greedy(f, g.prompt, args.tokens, "predictor", gpuidx=idx)
    note = [ours.error]
    if ours.loads:
        import powerinfer_engine as engine

        with engine.Model(f, threads=1, sparse_mode="predictor", gpuidx=idx, cpu_hot_tier=True) as m:
            m.eval([1, 2, 3])
            hot = [layer["hot_neurons"] for layer in m.stats()["layers"]]
        note = [f"GPU neurons per layer read here: {hot}", others_hottest(idx, prof / "activation", n_layer)]
    row(idx.name, "PowerInfer solver (powerinfer-py)", "ours predictor / PowerInfer main", ours.loads,
        agreement(g, ours), note="; ".join(n for n in note if n))


def others_hottest(idx: Path, activation: Path, n_layer: int) -> str:
    """Layers whose index marks neurons other than that layer's hottest: its export_split.py sorts the activation
    file names as strings (load_activation_weights), so from 11 layers on layer i gets another layer's counts."""
    import torch

    from powerinfer_tools.formats.gguf_io import open_reader

    tensors = open_reader(idx).tensors
    wrong = []
    for i in range(n_layer):
        mask = np.asarray(tensors[2 * i].data).astype(bool)
        counts = torch.load(activation / f"activation_{i}.pt", weights_only=True).numpy()
        hottest = np.argsort(-counts, kind="stable")[:int(mask.sum())]
        if mask.sum() and np.mean(mask[hottest]) < 0.9:
            wrong.append(i)
    return f"layers given other layers' hottest neurons: {wrong}" if wrong else "each layer's hottest neurons"


def refusal(work: Path, pi: PowerInfer, args) -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    import tiny_models

    log = work / "log.txt"
    hf = work / "hf-llama-silu"
    if not (hf / "config.json").is_file():
        tiny_models.make_tiny("llama-silu", hf, n_ff=args.n_ff)
    prof = work / "prof"
    if not (prof / "profile.json").is_file():
        pi_tools("profile", "-m", hf, "--out", prof, "--calib", DATA / "tinyshakespeare.txt", "--tokens", 2048,
                 "--seq-len", 128, "--target-sparsity", "0.5", "--force", log=log)
    pred = work / "pred"
    if not (pred / "config.json").is_file():
        pi_tools("train-predictor", prof, "--out", pred, "--rank", 32, "--threads", 1, "--force", log=log)
    f = work / "llama-silu.f16.powerinfer.gguf"
    if not f.is_file():
        pi_tools("convert", "-m", hf, "--predictors", pred, "--profile", prof, "--outtype", "f16", "-o", f, "-q", log=log)
    g = pi.main(f, PROMPT, 4, work)
    ours = ours_greedy(f, [1, 2, 3], 4, "predictor")
    refused = (not g.loads) and "unknown model architecture" in g.error
    row(f.name, "pi-tools convert (thresholded SiLU)", "PowerInfer main", "refused" if refused else g.loads,
        note=(g.error if not g.loads else "PowerInfer ran it: it computes ReLU") + f"; ours loads: {ours.loads}")
    # a PWRI file without predictors: PowerInfer's sparse loader wants blk.N.fc1/fc2
    relu = work.parent / "llama-relu" / "hf"
    if relu.is_dir():
        f = work / "llama-relu.f16.no-predictors.powerinfer.gguf"
        if not f.is_file():
            pi_tools("convert", "-m", relu, "--outtype", "f16", "-o", f, "-q", log=log)
        g = pi.main(f, PROMPT, 4, work)
        ours = ours_greedy(f, [1, 2, 3], 4, "dense")
        row(f.name, "pi-tools convert (no predictors)", "PowerInfer main", "refused" if not g.loads else True,
            note=(g.error if not g.loads else "PowerInfer ran it") + f"; ours loads (dense): {ours.loads}")


def tiny_model(kind: str, work: Path, args) -> Path:
    sys.path.insert(0, str(ROOT / "tests"))
    import tiny_models

    hf = work / "hf"
    if not (hf / "config.json").is_file():
        tiny_models.HIDDEN = args.hidden  # PowerInfer's Falcon converter writes n_ff = 4 n_embd
        config = tiny_models._config

        def as_powerinfer_runs_it(kind, vocab, n_ff):
            """PowerInfer runs OPT with 2048 positions only (llama.cpp llm_load_hparams: n_ctx_train = 2050), and
            a Falcon with an output matrix of its own: its converter copies the checkpoint's tensors, and its
            loader wants output.weight (llm_load_sparse_model_tensors)."""
            c = config(kind, vocab, n_ff)
            if kind == "opt":
                c.max_position_embeddings = 2048
            if kind == "falcon":
                c.tie_word_embeddings = False
            return c

        tiny_models._config = as_powerinfer_runs_it
        tiny_models.make_tiny(kind, hf, n_ff=args.n_ff)
        tiny_models._config = config
        cfg = json.loads((hf / "config.json").read_text())
        if "rope_parameters" in cfg:  # PowerInfer's converters read a top-level rope_theta (transformers 4's)
            cfg["rope_theta"] = cfg["rope_parameters"]["rope_theta"]
        (hf / "config.json").write_text(json.dumps(cfg, indent=2))
    return hf


def profile(hf: Path, work: Path, args) -> Path:
    prof = work / "prof"
    if not (prof / "profile.json").is_file():
        pi_tools("profile", "-m", hf, "--out", prof, "--calib", DATA / "tinyshakespeare.txt", "--tokens",
                 args.profile_tokens, "--seq-len", 128, "--force", log=work / "log.txt")
    return prof


def profile_and_train(hf: Path, work: Path, args) -> tuple[Path, Path]:
    log = work / "log.txt"
    prof, pred = profile(hf, work, args), work / "pred"
    if not (pred / "config.json").is_file():
        pi_tools("train-predictor", prof, "--out", pred, "--rank", args.rank, "--threads", 1, "--force", log=log)
    return prof, pred


CONVERTERS = {"llama-relu": ["convert.py", "convert-hf-to-powerinfer-gguf.py"], "bamboo": ["convert.py"],
              "falcon": ["convert-hf-to-powerinfer-gguf.py"], "opt": ["convert-hf-to-powerinfer-gguf.py"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("build", type=Path, help="PowerInfer build directory (bin/main, bin/perplexity, bin/quantize)")
    ap.add_argument("--source", type=Path, help="PowerInfer source directory [default: the build's parent]")
    ap.add_argument("--work", type=Path, required=True, help="where models and files are made (reused if there)")
    ap.add_argument("--kinds", default="llama-relu,bamboo,falcon,opt", help="tiny models to build")
    ap.add_argument("--hf", type=Path, action="append", default=[], help="an HF ReLU llama directory (repeatable)")
    ap.add_argument("--hf-profile", type=Path, help="a profile of the --hf model (else profiled here)")
    ap.add_argument("--hf-predictors", type=Path, help="predictors of the --hf model (else trained here)")
    ap.add_argument("--types", default="f32,f16,q8_0,q4_0")
    ap.add_argument("--ppl-types", default="f32,f16")
    ap.add_argument("--their-quants", default="q8_0,q4_0")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--ctx", type=int, default=128, help="perplexity window")
    ap.add_argument("--chunks", type=int, default=8, help="perplexity windows")
    ap.add_argument("--hidden", type=int, default=320)
    ap.add_argument("--n-ff", type=int, default=1280, help="above 1000: PowerInfer's main sparse kernels")
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--profile-tokens", type=int, default=8192)
    ap.add_argument("--vram-budget", default="0.005", help="GiB for pi-tools plan's index of the tiny models")
    ap.add_argument("--hf-vram-budget", default="0.25", help="GiB for pi-tools plan's index of the --hf models")
    ap.add_argument("--numpy1-path", default=os.environ.get("PI_NUMPY1_PATH", ""),
                    help="PYTHONPATH entry holding numpy<2, for PowerInfer's gguf-py (its converters and solver)")
    ap.add_argument("--gguf-bin", type=Path, help="PowerInfer's examples/gguf binary [default: BUILD/bin/gguf]; "
                    "its CMake builds it with `make gguf`")
    ap.add_argument("--solver-path", default=os.environ.get("PI_SOLVER_PATH", ""),
                    help="PYTHONPATH entry holding cvxopt for PowerInfer's solver")
    ap.add_argument("--default-pipeline-only", action="store_true",
                    help="only the default pipeline's files (train-predictor and convert with their defaults) in "
                         "PowerInfer's main and ours: needs bin/main alone")
    args = ap.parse_args()
    for key in ("types", "ppl_types", "their_quants"):
        setattr(args, key, [t for t in getattr(args, key).split(",") if t])
    args.work, args.build = args.work.resolve(), args.build.resolve()  # its tools run inside the work directory
    args.hf = [p.resolve() for p in args.hf]
    args.hf_profile = args.hf_profile and args.hf_profile.resolve()
    args.hf_predictors = args.hf_predictors and args.hf_predictors.resolve()
    args.gguf_bin = args.gguf_bin and args.gguf_bin.resolve()
    source = args.source or args.build.parent
    args.work.mkdir(parents=True, exist_ok=True)
    pi = PowerInfer(args.build.resolve(), source.resolve(), args.work / "powerinfer.log", args.solver_path,
                    args.gguf_bin, args.numpy1_path)
    eval_text = args.work / "eval.txt"
    eval_text.write_text((DATA / "wikitext-2-raw-test.txt").read_text()[:20_000])
    commit = subprocess.run(["git", "-C", source, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or "unknown"
    print(f"PowerInfer {commit} at {args.build}")

    for kind in [k for k in args.kinds.split(",") if k]:
        print(f"== {kind}", flush=True)
        work = args.work / kind
        work.mkdir(exist_ok=True)
        hf = tiny_model(kind, work, args)
        if args.default_pipeline_only:
            default_pipeline(kind, hf, work, pi, args, profile(hf, work, args))
            continue
        prof, pred = profile_and_train(hf, work, args)
        ours_to_theirs(kind, hf, work, pi, args, prof, pred, eval_text)
        theirs_to_ours(kind, hf, work, pi, args, prof, pred, eval_text, CONVERTERS.get(kind, []))
        solver_both_ways(kind, hf, work, pi, args, prof)
    for hf in args.hf:
        name = hf.name
        print(f"== {name}", flush=True)
        work = args.work / name
        work.mkdir(exist_ok=True)
        if args.default_pipeline_only:
            default_pipeline(name, hf, work, pi, args, args.hf_profile or profile(hf, work, args))
            continue
        prof, pred = args.hf_profile, args.hf_predictors
        if prof is None or pred is None:
            prof, pred = profile_and_train(hf, work, args)
        ours_to_theirs(name, hf, work, pi, argparse.Namespace(**{**vars(args), "vram_budget": args.hf_vram_budget}),
                       prof, pred, eval_text)
        theirs_to_ours(name, hf, work, pi, args, prof, pred, eval_text, CONVERTERS["llama-relu"])
        solver_both_ways(name, hf, work, pi, args, prof)
    if not args.default_pipeline_only:
        print("== refusal", flush=True)
        (args.work / "silu").mkdir(exist_ok=True)
        refusal(args.work / "silu", pi, args)
    table = print_table()
    (args.work / "table.md").write_text(f"PowerInfer {commit}\n\n{table}\n")
    print(f"\nPowerInfer {commit}\n\n{table}")


if __name__ == "__main__":
    main()
