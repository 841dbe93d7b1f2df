"""The OpenAI-compatible API under /v1: request serializers, response shapes, and the thin views."""
