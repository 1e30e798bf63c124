"""Weights through the swarm: manifests' chunks fetched from and served to peers."""
