"""GGUF files: reading headers and tensors by range, and writing derived MoE files."""
