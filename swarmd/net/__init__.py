"""The network seam: the `Network` protocol, its libp2p implementation, the peer gate, identity and access."""
