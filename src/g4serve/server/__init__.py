"""OpenAI-compatible HTTP server: ``g4serve serve`` (see docs/api.md)."""
