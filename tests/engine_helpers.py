"""Shared by the engine tests: tiny models converted once per session, transformers reference
logits (optionally with the FFN sparsified exactly as an engine mode defines it), gpuidx files,
edited copies of a file (`rewrite`), a file changed under the same size and modification time
(`replace_keeping_size_and_time`), a command that must not hang (`run_with_timeout`)."""
from __future__ import annotations

import inspect
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from convert_helpers import write_predictors

from powerinfer_tools.models import arch
from powerinfer_tools import models
from powerinfer_tools.stages.conversion.conversion import convert_model
from powerinfer_tools.formats.gguf_io import open_reader, set_pwri_magic


@pytest.fixture(scope="session")
def converted(tiny_model_dir, tmp_path_factory):
    """converted(kind, outtype="f32", predictors=False, thresholds=None, powerinfer_compatible=False) -> path of
    the tiny model as a PowerInfer file; predictors: random ones (threshold 0); thresholds: per-layer |a|
    thresholds; powerinfer_compatible: convert's default (ffn_down_t f16 in f32/q8_0 files), off here so that
    an f32 file holds the model's own weights."""
    import json

    cache = {}
    root = tmp_path_factory.mktemp("engine_models")

    def get(kind: str, outtype: str = "f32", predictors: bool = False, thresholds: tuple | None = None,
            powerinfer_compatible: bool = False) -> Path:
        key = (kind, outtype, predictors, thresholds, powerinfer_compatible)
        if key not in cache:
            src = tiny_model_dir(kind)
            pred_dir = profile_dir = None
            if thresholds is not None:  # the one profile.json field the converter reads
                profile_dir = root / f"profile_{kind}_{len(cache)}"
                profile_dir.mkdir()
                (profile_dir / "profile.json").write_text(json.dumps({"thresholds": list(thresholds)}))
            if predictors:
                config = models.load_config(models.resolve(str(src)))
                dims = arch.for_config(config).dims()
                pred_dir = write_predictors(root / f"pred_{kind}", dims.n_layer, dims.n_embd, dims.n_ff, rank=32,
                                            thresholds=[0.0] * dims.n_layer)
            out = root / f"{kind}.{outtype}.{len(cache)}.gguf"
            convert_model(str(src), out, outtype=outtype, predictors_dir=pred_dir, profile_dir=profile_dir,
                          progress=False, powerinfer_compatible=powerinfer_compatible)
            cache[key] = out
        return cache[key]

    return get


def random_tokens(n: int, vocab: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(3, vocab, size=n).tolist()


def hf_model(model_dir: Path):
    return models.load_model(models.resolve(str(model_dir)))


# the modules whose input the engine multiplies as q8_0 blocks (a mixture's experts: their gate and up)
Q8_INPUT_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "lm_head", "experts")


def q8_round_trip(x: torch.Tensor) -> torch.Tensor:
    """x through gguf-py's q8_0 quantizer and back (along the last dimension)."""
    import gguf

    q = gguf.quants.quantize(x.detach().float().numpy(), gguf.GGMLQuantizationType.Q8_0)
    return torch.from_numpy(gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0)).to(x.dtype)


def hf_logits(model_dir: Path, tokens: list[int], mask_fn=None, weights_from: Path | None = None,
              q8_inputs: bool = False, kv_f16: bool = False, float64: bool = False, q8_down: bool = False) -> np.ndarray:
    """transformers' logits [len(tokens), vocab]; mask_fn(layer, x_pred, a) -> a' sparsifies the FFN
    activation of each layer from its predictor input x_pred (the residual entering the FFN block);
    weights_from: run with the weights stored in that converted file instead; q8_inputs: round the
    inputs of the projections that the engine multiplies as q8_0 blocks (all but the down projection);
    kv_f16: attention reads keys (after RoPE) and values rounded to f16, as from a half-precision KV cache;
    float64: computed in float64 (the reference every tier's own arithmetic is bounded against); q8_down: the down
    projection's input rounded so (h in q8_0 per 32 neurons: a dense step over llama.cpp's
    ffn_down as stored, docs/engine.md "The down projection as stored")."""
    model, adapter = hf_model(model_dir)
    if weights_from is not None:
        c = model.config
        load_file_weights(model, weights_from, c.num_attention_heads, c.num_key_value_heads)
    if float64:
        model = model.double()
    handles = []
    rounded = (Q8_INPUT_LINEARS if q8_inputs else ()) + (("down_proj",) if q8_down else ())
    if rounded:
        for name, module in model.named_modules():
            if name.split(".")[-1] in rounded:
                handles.append(module.register_forward_pre_hook(lambda mod, args: (q8_round_trip(args[0]), *args[1:])))
    if mask_fn is not None:
        inputs = {}
        handles += arch.install_taps(adapter, model, on_input=lambda i, x: inputs.__setitem__(i, x),
                                    on_activation=lambda i, a: mask_fn(i, inputs[i], a))
    cache = {}
    if kv_f16:
        from transformers import DynamicCache

        class HalfCache(DynamicCache):
            def update(self, key_states, value_states, *args, **kwargs):
                return super().update(key_states.half().float(), value_states.half().float(), *args, **kwargs)

        name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        cache = {name: HalfCache(), "use_cache": True}
    try:
        with torch.no_grad():
            logits = model(torch.tensor([tokens]), **cache).logits[0]
            return logits.numpy() if float64 else logits.float().numpy()
    finally:
        for h in handles:
            h.remove()


def predictor_rule(path: Path, thresholds=None):
    """The predictor mode's FFN in torch, as hf_logits' mask_fn: a neuron counts when the file's predictor selects it
    (logit > the layer threshold) and, for SiLU, |a| passes the activation threshold. A quantized fc1 (fc2)
    multiplies its input (the hidden layer) rounded through q8_0, as the engine's integer dots do."""
    from convert_helpers import read_fields, read_tensors

    tensors = read_tensors(path)
    pred_thr = read_fields(path)["powerinfer.predictor_thresholds"]

    def mask(i, x, a):
        fc1_type, fc1 = tensors[f"blk.{i}.fc1.weight"]
        fc2_type, fc2 = tensors[f"blk.{i}.fc2.weight"]
        if fc1_type in ("Q8_0", "Q4_0"):
            x = q8_round_trip(x)
        hidden = torch.relu(x @ torch.from_numpy(fc1).T)
        if fc2_type in ("Q8_0", "Q4_0"):
            hidden = q8_round_trip(hidden)
        selected = (hidden @ torch.from_numpy(fc2).T) > pred_thr[i]
        keep = selected & (a.abs() > thresholds[i]) if thresholds else selected
        return a * keep
    return mask


def auto_run(path: Path, tokens: list[int], n_prompt: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """Auto mode's logits (the first n_prompt tokens as one batch, then decode steps) and, for each layer, the
    positions whose FFN it computed by the predictor (from each step's per-mode token counts): the values auto's
    choices define, whichever it made."""
    import powerinfer_engine as engine

    predicted: dict[int, np.ndarray] = {}
    rows = []
    with engine.Model(path, threads=2, sparse_mode="auto") as m:
        for start, end in [(0, n_prompt)] + [(p, p + 1) for p in range(n_prompt, len(tokens))]:
            m.reset_stats()
            rows.append(m.eval(tokens[start:end]).reshape(end - start, -1))
            for layer in m.stats()["layers"]:
                modes = layer["modes"]
                assert set(modes) <= {"gate", "dense_rule", "predictor"} and len(modes) == 1, modes  # one per step
                predicted.setdefault(layer["layer"], np.zeros(len(tokens), bool))[start:end] = "predictor" in modes
    return np.concatenate(rows), [predicted[i] for i in sorted(predicted)]


def load_file_weights(model, path: Path, n_head: int, n_kv: int) -> None:
    """Overwrite a Llama-family transformers model's weights with the (dequantized) weights of a
    converted file (weights and biases), undoing the converter's q/k row permutation (llama's, not NeoX RoPE's
    qwen3moe and olmoe) and the down transpose (a llama.cpp file's ffn_down is taken as it is); a mixture's router and stacked experts into transformers' own
    parameters."""
    from convert_helpers import read_tensors
    from powerinfer_tools.formats.gguf_io import open_reader

    neox = open_reader(path).fields["general.architecture"].contents().split("-")[0] in ("qwen3moe", "olmoe")

    def unrope(w, heads):
        d = w.shape[0] // heads
        perm = [h * d + r // 2 + (r % 2) * (d // 2) for h in range(heads) for r in range(d)]
        out = np.empty_like(w)
        out[perm] = w
        return out

    names = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
    per_layer = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                 "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                 "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                 "ffn_down_t": "mlp.down_proj", "ffn_down": "mlp.down_proj", "ffn_gate_inp": "mlp.gate"}
    state = model.state_dict()
    with torch.no_grad():
        for name, (_, w) in read_tensors(path).items():
            if name.startswith("blk."):
                _, i, kind, part = name.split(".")
                experts = f"model.layers.{i}.mlp.experts."
                if kind in ("ffn_gate_exps", "ffn_up_exps"):  # the halves of transformers' gate_up_proj
                    half = state[f"{experts}gate_up_proj"].shape[1] // 2
                    rows = slice(0, half) if kind == "ffn_gate_exps" else slice(half, 2 * half)
                    state[f"{experts}gate_up_proj"][:, rows].copy_(torch.from_numpy(np.ascontiguousarray(w)))
                    continue
                if kind == "ffn_down_exps":
                    state[f"{experts}down_proj"].copy_(torch.from_numpy(np.ascontiguousarray(w)))
                    continue
                if kind not in per_layer:
                    continue
                target = f"model.layers.{i}.{per_layer[kind]}.{part}"
                w = {"attn_q": lambda: w if neox else unrope(w, n_head),
                     "attn_k": lambda: w if neox else unrope(w, n_kv), "ffn_down_t": lambda: w.T}.get(kind, lambda: w)()
            else:
                target = names[name]
            state[target].copy_(torch.from_numpy(np.ascontiguousarray(w)))


def max_rel_err(got: np.ndarray, ref: np.ndarray) -> float:
    """max |got - ref| over max |ref|: the error relative to the logits' scale."""
    return float(np.abs(got - ref).max() / np.abs(ref).max())


def engine_prompt_then_decode(model, tokens: list[int], n_prompt: int) -> np.ndarray:
    """Logits of every position: the first n_prompt tokens as one batch, the rest one at a time."""
    rows = [model.eval(tokens[:n_prompt])]
    rows += [model.eval([t])[None, 0] for t in tokens[n_prompt:]]
    return np.concatenate(rows)


def write_gpuidx(path: Path, hot: list[np.ndarray], vram_bytes: int = 1 << 30) -> Path:
    """A PowerInfer GPU index (docs/formats.md) marking hot[i] (bool [n_ff]) of each layer."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "generic.gpu_index")
    writer.add_uint32("generic.gpu_index.block_count", len(hot))
    writer.add_uint64("split.vram_capacity", vram_bytes)
    for i, mask in enumerate(hot):
        writer.add_tensor(f"blk.{i}.gpu_idx", mask.astype(np.int32))
        writer.add_tensor(f"blk.{i}.gpu_bucket", np.flatnonzero(mask).astype(np.int32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    set_pwri_magic(path)
    return path


def rewrite(src: Path, dst: Path, fields: dict | None = None, drop: tuple = (), tensors: dict | None = None,
            alignment: int | None = None) -> Path:
    """Copy a GGUF/PWRI file through gguf-py, replacing or adding metadata values (key -> (value, type)
    or None to drop), dropping tensors, or replacing tensors (name -> (array, raw ggml type or None));
    alignment: the data laid out at that alignment, and general.alignment saying so."""
    reader = open_reader(src)
    fields, tensors = dict(fields or {}), tensors or {}
    writer = gguf.GGUFWriter(str(dst), arch="_")
    if alignment is not None:
        writer.data_alignment = alignment
        fields["general.alignment"] = (alignment, gguf.GGUFValueType.UINT32)
    writer.kv_data[0].clear()  # the writer's own general.architecture: copied below instead
    for name, f in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        if name in fields:
            if fields[name] is not None:
                writer.add_key_value(name, fields[name][0], fields[name][1])
            continue
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, f.contents(), f.types[0], sub_type=sub)
    for name, value in fields.items():  # keys the source lacks
        if name not in reader.fields and value is not None:
            writer.add_key_value(name, value[0], value[1])
    for t in reader.tensors:
        if t.name in drop:
            continue
        if t.name in tensors:
            data, raw = tensors[t.name]
            writer.add_tensor(t.name, data, raw_dtype=raw)
        elif t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            writer.add_tensor(t.name, np.array(t.data), raw_shape=list(reversed([int(n) for n in t.shape])),
                              raw_dtype=t.tensor_type)
        else:  # quantized: the reader's data is already in the byte shape the writer expects
            writer.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    finish_gguf(writer)
    set_pwri_magic(dst)
    return dst


def finish_gguf(writer: gguf.GGUFWriter, tensors: dict | None = None) -> None:
    """Add `tensors` (name -> array) to a gguf-py writer, then write its file and close it."""
    for name, data in (tensors or {}).items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="session")
def smollm2_q8_0(smollm2_file) -> Path:
    """The default model as convert writes it by default in q8_0 (the layout `pi-tools run` uses, without
    predictors): conftest's smollm2_file, since a SiLU model's file is the same whether or not it is asked to be
    PowerInfer's (PowerInfer refuses SiLU models; conversion.convert_model)."""
    return smollm2_file("q8_0")


def replace_keeping_size_and_time(path: Path, other: Path, how: str) -> None:
    """Makes `path` hold `other`'s bytes (of the same size), written over it ("in place") or renamed over it
    ("renamed over"), and gives it back its modification time to the nanosecond: what a copy then `touch -r`, tar
    or os.utime leave. Only the change time (and, renamed, the inode) tells the files apart."""
    before = os.stat(path)
    assert os.path.getsize(other) == before.st_size
    if how == "in place":
        with open(path, "r+b") as f:
            f.write(Path(other).read_bytes())
        os.unlink(other)
    else:
        os.replace(other, path)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(path)
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)


def run_with_timeout(script: str, *args, timeout: float = 120) -> subprocess.CompletedProcess:
    """`script` run by this Python in a child process that is killed after `timeout` seconds (a hang fails the test
    with subprocess.TimeoutExpired instead of hanging the suite)."""
    return subprocess.run([sys.executable, "-c", script, *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)
