"""HTTP: the daemon's API app, auth, streaming, the OpenAI-compatible routes and `/api/v0/generate`."""
