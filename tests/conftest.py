import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import KINDS, make_tiny  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """tiny_model_dir(kind) -> Path of a saved tiny random model (built once per session)."""
    cache = {}

    def get(kind: str) -> Path:
        if kind not in cache:
            cache[kind] = make_tiny(kind, tmp_path_factory.mktemp(kind.replace("-", "_")))
        return cache[kind]

    return get


@pytest.fixture(params=KINDS)
def tiny_kind(request):
    return request.param


@pytest.fixture(autouse=True, scope="session")
def _tokenizer_cache(tmp_path_factory):
    """Tokenizers built during the tests are cached in the session's temporary directory, not the user's cache
    (where they would push out the user's own; the smollm2 GGUF itself stays found where it is)."""
    from powerinfer_tools.formats import tokenizer

    root = tmp_path_factory.mktemp("tokenizer_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tokenizer, "cache_root", lambda: root)
        yield root


@pytest.fixture(scope="session")
def smollm2_file(tmp_path_factory):
    """smollm2_file(outtype) -> Path of the real SmolLM2 converted to that type, every matrix in it (PowerInfer's
    f16 down projection left out: the engine on the type named), no predictors; built once per session."""
    from powerinfer_tools.stages.conversion.conversion import convert_model

    root = tmp_path_factory.mktemp("smollm2")

    def get(outtype: str) -> Path:
        path = root / f"smollm2.{outtype}.powerinfer.gguf"
        if not path.exists():
            convert_model("smollm2", path, outtype=outtype, progress=False, powerinfer_compatible=False)
        return path

    return get


# role and content between <s> and </s> (the tiny tokenizer's BOS and EOS): a reply ends at </s>
TINY_CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
                      "{% if add_generation_prompt %}<s>assistant:{% endif %}")


@pytest.fixture(scope="session")
def tiny_chat_file(tiny_model_dir, tmp_path_factory):
    """The tiny llama-relu model as an f32 PowerInfer file carrying a chat template: the text API, `chat` and
    `serve` in seconds instead of the real model's minutes."""
    import gguf

    from engine_helpers import rewrite
    from powerinfer_tools.stages.conversion.conversion import convert_model

    root = tmp_path_factory.mktemp("tiny_chat")
    convert_model(str(tiny_model_dir("llama-relu")), root / "tiny.gguf", outtype="f32", progress=False,
                  powerinfer_compatible=False)
    return rewrite(root / "tiny.gguf", root / "tiny-chat.gguf",
                   fields={"tokenizer.chat_template": (TINY_CHAT_TEMPLATE, gguf.GGUFValueType.STRING)})
