"""OpenAI-compatible HTTP server: `python -m specpcg serve` (FastAPI + uvicorn)."""
