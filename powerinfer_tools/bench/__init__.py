"""`pi-tools bench`: our engine against llama.cpp and transformers. It sits on top of the toolkit: nothing else
imports it."""
