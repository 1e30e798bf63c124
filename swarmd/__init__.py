"""swarmd: a peer-to-peer swarm daemon that serves language models from many GPUs."""

__version__ = "0.1.0"
WIRE_VERSION = 2  # bumped on any incompatible change to gossip or actor messages
