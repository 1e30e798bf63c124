"""Observability: metrics, spans, Chrome traces, trace collection and summaries, clock offsets."""
