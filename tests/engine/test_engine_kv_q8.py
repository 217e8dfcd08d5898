"""The q8_0 KV cache (llama.cpp's --cache-type-k/v q8_0, on request): its kernels against float64 and across sets,
its bytes, and what it costs in logits beside the f32 and f16 caches, against a float64 reference on tiny models
whose heads are whole q8_0 blocks (Qwen3's 32-wide heads, a Llama with 2 heads of 32 sharing one kv head)."""
from __future__ import annotations

import numpy as np
import pytest
from cli_helpers import run_cli
from engine_helpers import converted, engine_prompt_then_decode, hf_logits, max_rel_err, random_tokens  # noqa: F401
from tiny_models import HIDDEN, make_tiny

import powerinfer_engine as engine
from powerinfer_engine import kernels
from powerinfer_tools.stages.conversion.conversion import convert_model

SIMD = [isa for isa in ("avx2", "avx512") if kernels.available(isa)]

N_PROMPT, N_TOKENS = 100, 300  # past the tiny models' 256-position training context, several key tiles
# max |logit - float64 reference| / max |reference| over the 300 positions, as measured (f32 / f16 / q8_0):
# qwen3 4.8e-7 / 2.5e-4 / 8.2e-3, llama 5.3e-7 / 3.9e-4 / 7.5e-3; the bounds about 2x the larger of each
BOUNDS = {"f32": 1e-6, "f16": 8e-4, "q8_0": 1.6e-2}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """kind -> (Hugging Face directory, f32 file): qwen3 (head_dim 32), llama (2 query heads of 32, 1 kv head)."""
    root = tmp_path_factory.mktemp("kv_q8")
    out = {}
    for kind, src, overrides in (("qwen3", "qwen3", {}),
                                 ("llama", "llama-silu", {"num_attention_heads": 2, "num_key_value_heads": 1})):
        directory = make_tiny(src, root / kind, **overrides)
        path = root / f"{kind}.f32.gguf"
        convert_model(str(directory), path, outtype="f32", progress=False, powerinfer_compatible=False)
        out[kind] = (directory, path)
    return out


def q8_blocks(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x [..., n] (n % 32 == 0) -> q8_0 quants and float16 scales along the last axis, as gguf-py quantizes."""
    b = x.reshape(*x.shape[:-1], -1, 32).astype(np.float32)
    d = (np.abs(b).max(-1, keepdims=True) / 127).astype(np.float32)
    q = np.round(np.where(d == 0, 0, b / np.where(d == 0, 1, d))).astype(np.int8)
    return q.reshape(x.shape), d[..., 0].astype(np.float16)


@pytest.mark.parametrize("isa", ["scalar"] + SIMD)
@pytest.mark.parametrize("n_tok,n_rows,n_cols", [(1, 32, 64), (3, 64, 40), (4, 128, 64), (5, 96, 7), (2, 32, 17)])
def test_key_tile_gemm_is_h_at_the_widened_tile(isa, n_tok, n_rows, n_cols):
    """A key tile [d_head][64], each position's column in blocks of 32 down the rows with its scale: y + h @ w for w
    the quants times their scales, bit-identical to gemm_f32 over that widened tile in every set (masked tails of
    7 and 17 columns, a decode step's last keys)."""
    rng = np.random.default_rng(n_tok * 1000 + n_rows + n_cols)
    keys = rng.normal(0, 2, (64, n_rows))  # [position][d]
    q, s = q8_blocks(keys)  # q [64][n_rows], s [64][n_rows / 32]
    tile_q, tile_s = np.ascontiguousarray(q.T), np.ascontiguousarray(s.T)  # [d][64], [d / 32][64]
    widened = (tile_q.astype(np.float32) * np.repeat(tile_s.astype(np.float32), 32, axis=0))[:, :n_cols]
    h, y = rng.normal(0, 1, (n_tok, n_rows)), rng.normal(0, 1, (n_tok, n_cols)).astype(np.float32)
    got = kernels.gemm_q8(isa, h, tile_q, tile_s, y, columns=True)
    np.testing.assert_array_equal(got, kernels.gemm_f32("scalar", h, widened, y))
    exact = y + h.astype(np.float32).astype(np.float64) @ widened.astype(np.float64)
    np.testing.assert_allclose(got, exact, rtol=1e-5, atol=1e-5 * np.sqrt(n_rows) * np.abs(widened).max())


@pytest.mark.parametrize("isa", ["scalar"] + SIMD)
@pytest.mark.parametrize("n_tok,n_rows,n_cols", [(1, 64, 64), (3, 17, 32), (4, 200, 128), (2, 5, 96)])
def test_value_gemm_is_p_at_the_widened_rows(isa, n_tok, n_rows, n_cols):
    """Values [position][d_head], each row in blocks of 32 with its scale: the same, y + p @ w."""
    rng = np.random.default_rng(7 + n_tok * 1000 + n_rows + n_cols)
    q, s = q8_blocks(rng.normal(0, 2, (n_rows, n_cols)))
    widened = q.astype(np.float32) * np.repeat(s.astype(np.float32), 32, axis=1)
    h, y = rng.random((n_tok, n_rows)), rng.normal(0, 1, (n_tok, n_cols)).astype(np.float32)
    got = kernels.gemm_q8(isa, h, q, s, y, columns=False)
    np.testing.assert_array_equal(got, kernels.gemm_f32("scalar", h, widened, y))
    exact = y + h.astype(np.float32).astype(np.float64) @ widened.astype(np.float64)
    np.testing.assert_allclose(got, exact, rtol=1e-5, atol=1e-5 * np.sqrt(n_rows) * np.abs(widened).max())


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_logits_of_each_cache_type_against_float64(models, kind):
    """A prompt batch then decode steps past the training context, each cache type against transformers in float64:
    f32 within float rounding, f16 and q8_0 within their measured bounds (BOUNDS), the error growing with the
    cache's rounding; q8_0's decode steps the same bits at 1 and 2 threads."""
    directory, path = models[kind]
    tokens = random_tokens(N_TOKENS, 300, seed=11)
    ref = hf_logits(directory, tokens, float64=True)
    errors = {}
    for kv_type in BOUNDS:
        with engine.Model(path, threads=2, ctx_size=320, batch_size=48, kv_type=kv_type) as m:
            assert m.info["kv_type"] == kv_type
            logits = engine_prompt_then_decode(m, tokens, N_PROMPT)
        errors[kv_type] = max_rel_err(logits, ref)
        if kv_type == "q8_0":
            with engine.Model(path, threads=1, ctx_size=320, batch_size=48, kv_type=kv_type) as m:
                np.testing.assert_array_equal(engine_prompt_then_decode(m, tokens, N_PROMPT)[N_PROMPT:],
                                              logits[N_PROMPT:])
    assert all(errors[t] <= BOUNDS[t] for t in BOUNDS), errors
    assert errors["f32"] < errors["f16"] < errors["q8_0"], errors


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_q8_0_greedy_tokens_equal_f32s_over_32_steps(models, kind):
    """Greedy decoding from a prompt: the same 32 tokens with a q8_0 cache as with the f32 one."""
    _, path = models[kind]
    prompt = random_tokens(40, 300, seed=5)
    generated = {}
    for kv_type in ("f32", "q8_0"):
        with engine.Model(path, threads=2, ctx_size=128, kv_type=kv_type) as m:
            logits, out = m.eval(prompt, all_logits=False), []
            for _ in range(32):
                out.append(int(np.argmax(logits)))
                logits = m.eval([out[-1]], all_logits=False)
        generated[kv_type] = out
    assert generated["q8_0"] == generated["f32"]


@pytest.mark.parametrize("kv_type", ["f32", "f16", "q8_0"])
def test_a_batch_equals_its_tokens_one_at_a_time(models, kv_type):
    """The cache's rounding is per position (a q8_0 block is one position's 32 elements), so a prompt in one batch
    and the same tokens one at a time read the same cached bits and give the same logits."""
    _, path = models["llama"]
    tokens = random_tokens(70, 300, seed=8)
    with engine.Model(path, threads=2, ctx_size=128, kv_type=kv_type) as m:
        batch = m.eval(tokens)
    with engine.Model(path, threads=2, ctx_size=128, kv_type=kv_type) as m:
        single = np.concatenate([m.eval([t]) for t in tokens])
    np.testing.assert_array_equal(batch, single)


def test_q8_0_cache_bytes_and_refusal(models, converted):
    """34 bytes per 32 elements (17/64 of f32's), counted in the open's memory figures; a model whose heads are
    not whole blocks (the tiny Llama's 16-wide heads) is refused in one line."""
    _, path = models["llama"]
    sizes = {}
    for kv_type in ("f32", "q8_0"):
        with engine.Model(path, threads=1, ctx_size=200, kv_type=kv_type) as m:
            sizes[kv_type] = m.info["kv_cache_bytes"]
    assert sizes["q8_0"] * 64 == sizes["f32"] * 17
    with pytest.raises(engine.EngineError, match="kv_type q8_0 needs a head size that is a multiple of 32"):
        engine.Model(converted("llama-silu"), kv_type="q8_0")
    assert HIDDEN // 4 % 32 != 0


def test_run_takes_kv_type_q8_0(models, capsys):
    """`pi-tools run --kv-type q8_0` opens the cache it names and says so in its memory line."""
    _, path = models["qwen3"]
    code, _, err = run_cli(capsys, "run", "-m", path, "-p", "The king", "-n", "4", "-t", "2", "-c", "256",
                           "--kv-type", "q8_0", "-v")
    with engine.Model(path, ctx_size=256, kv_type="q8_0") as m:
        kv = m.info["kv_cache_bytes"]
    assert code == 0 and f"KV cache {kv / 2**20:.1f} MiB (q8_0)" in err, err
