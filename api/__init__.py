"""The OpenAI-compatible HTTP gateway (the only package that imports `fastapi`)."""
