"""The head: the daemon that accepted a request (tokens, streaming, moves after failures)."""
