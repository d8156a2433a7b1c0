"""`python -m specpcg serve`: the engine behind an OpenAI-compatible HTTP server (uvicorn)."""

from __future__ import annotations

import logging

logger = logging.getLogger("specpcg")


def served_name(engine, name=None) -> str:
    if name:
        return name
    import os

    path = engine.config.model_path
    return os.path.basename(str(path).rstrip("/")) if path else "SmolLM2-135M-Instruct"


def serve(engine, host: str = "127.0.0.1", port: int = 30000, model_name=None,
          log_level: str = "info") -> None:
    import uvicorn

    from specpcg.serve.app import create_app

    app = create_app(engine, served_name(engine, model_name))
    logger.info("serving %s on http://%s:%d/v1", app.state.model_name, host, port)
    try:
        uvicorn.run(app, host=host, port=port, log_level=log_level)
    finally:
        engine.shutdown()
