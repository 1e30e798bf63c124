"""Model names and where their weights come from: the cache, Ollama, seeded and synthetic models."""
