"""One vocabulary: formats/names.py and csrc/include/pi_names.h spell the same names, and the engine numbers
its FFN modes in names.FFN_MODES's order."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from powerinfer_tools.formats import names

ROOT = Path(__file__).resolve().parents[2]
HEADER = ROOT / "csrc" / "include" / "pi_names.h"


def cpp_name(python_name: str) -> str:
    """KEY_FFN_ACTIVATION -> kKeyFfnActivation, FFN_DOWN_T -> kFfnDownT."""
    return "k" + "".join(part.capitalize() for part in python_name.lower().split("_"))


def python_vocabulary() -> dict[str, str | tuple[str, ...]]:
    return {cpp_name(k): v for k, v in vars(names).items() if k.isupper() and isinstance(v, (str, tuple))}


def header_vocabulary(text: str) -> dict[str, str | tuple[str, ...]]:
    strings = dict(re.findall(r'inline constexpr char (k\w+)\[\] = "([^"]*)";', text))
    lists = {name: tuple(re.findall(r'"([^"]*)"', body))
             for name, body in re.findall(r"inline constexpr const char \*(k\w+)\[\] = \{([^}]*)\};", text)}
    return strings | lists


def test_the_header_spells_every_python_name_and_no_other():
    python, header = python_vocabulary(), header_vocabulary(HEADER.read_text())
    assert len(python) > 15
    assert header == python


def test_a_name_changed_on_one_side_is_caught():
    text = HEADER.read_text().replace('"ffn_down_t"', '"ffn_down_T"')
    assert header_vocabulary(text) != python_vocabulary()


def test_the_engine_numbers_ffn_modes_in_the_vocabulary_order():
    from powerinfer_engine._lib import FFN_MODES

    assert tuple(FFN_MODES) == names.FFN_MODES and list(FFN_MODES.values()) == list(range(len(names.FFN_MODES)))
    enum = re.search(r"typedef enum \{(.*?)\} pi_ffn_mode;", (ROOT / "csrc/include/pi_engine.h").read_text(), re.S)
    numbered = re.findall(r"PI_FFN_(\w+) = (\d+)", enum.group(1))
    assert [(m.upper(), str(i)) for i, m in enumerate(names.FFN_MODES)] == numbered


def test_the_runtime_takes_the_vocabulary_modes():
    from powerinfer_tools.runtime import inference

    assert inference.SPARSE_MODES is names.FFN_MODES


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")
def test_the_header_compiles_and_counts_its_modes(tmp_path):
    probe = tmp_path / "probe.cpp"
    probe.write_text('#include "pi_names.h"\n'
                     f"static_assert(pi::names::kFfnModeCount == {len(names.FFN_MODES)});\n"
                     "int main() { return pi::names::kFfnModes[0][0] == 'd' ? 0 : 1; }\n")
    subprocess.run(["c++", "-std=c++17", "-fsyntax-only", "-I", str(HEADER.parent), str(probe)], check=True)


def test_llama_cpp_names_are_gguf_pys():
    """The hyperparameter keys the engine computes and the llama3 RoPE tensor are llama.cpp's, as gguf-py spells them."""
    import gguf

    keys = {v for group in vars(gguf.Keys).values() if isinstance(group, type)
            for k, v in vars(group).items() if k.isupper() and isinstance(v, str)}
    assert {f"{{arch}}.{suffix}" for suffix in names.ARCH_KEYS} <= keys
    assert names.ROPE_FREQS == gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight"


def test_layer_tensor_names():
    assert names.layer_tensor(3, names.FFN_DOWN_T) == "blk.3.ffn_down_t.weight"
    assert names.layer_tensor(0, names.FFN_UP, "bias") == "blk.0.ffn_up.bias"
    assert names.weight(names.PREDICTOR_FC1) == "fc1.weight"
