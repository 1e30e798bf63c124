"""Swarm membership, leader election and planning: sans-IO machines and the service that drives them."""
