"""Speculative decoding over the pipeline: the head drafts, the chain verifies several positions in one pass."""
