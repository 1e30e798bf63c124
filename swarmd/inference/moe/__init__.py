"""Mixture of experts across daemons: the router of a stage's MoE blocks and the expert actor."""
