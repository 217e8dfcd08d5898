"""The files the stages write and read: GGUF access, the one vocabulary of names, tokenizers, neuron order,
describing a file."""
