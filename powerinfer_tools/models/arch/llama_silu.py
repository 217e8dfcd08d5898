"""SiLU Llama/Mistral models (SmolLM2, Llama-2/3, Mistral): a = silu(gate x). Nothing is exactly zero,
so a neuron counts as active when |a| exceeds its layer's calibrated threshold (CATS)."""
from powerinfer_tools.models.arch.llama_family import LLAMA_MODEL_TYPES, LlamaFamily, hidden_act, is_bamboo


class LlamaSilu(LlamaFamily):
    name = "llama-silu"
    description = "Llama family with SiLU (SmolLM2, Llama-2/3, Mistral), thresholded"
    activation = "silu"

    @classmethod
    def matches(cls, config) -> bool:
        return (config.model_type in LLAMA_MODEL_TYPES and hidden_act(config) in ("silu", "swish")
                and not is_bamboo(config))
