"""Inference across the swarm: the pipeline's actors (head, stage, MoE) and the registry of who holds what."""
