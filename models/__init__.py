"""Models for swarmd on tinygrad: GGUF loading by layer range, pipeline stages with a KV cache per
request, tokenizer and chat template, model names. Imports nothing from `swarmd`."""
