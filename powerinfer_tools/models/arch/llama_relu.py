"""ReLU Llama models (ReluLLaMA 7B/13B/70B): a = relu(gate x), active when a > 0 (ProSparse: prosparse.py)."""
from powerinfer_tools.models.arch.llama_family import LLAMA_MODEL_TYPES, LlamaFamily, hidden_act, is_bamboo


class LlamaRelu(LlamaFamily):
    name = "llama-relu"
    description = "Llama family with ReLU (ReluLLaMA)"
    activation = "relu"

    @classmethod
    def matches(cls, config) -> bool:
        return config.model_type in LLAMA_MODEL_TYPES and hidden_act(config) == "relu" and not is_bamboo(config)
