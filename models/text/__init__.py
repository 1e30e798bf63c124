"""Text: the tokenizer rebuilt from a GGUF, and chat templates."""
