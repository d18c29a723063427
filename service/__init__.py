"""The overlap-autotuner REST service (FastAPI): ``create_app(settings)``; ``service.app:app``."""

from service.app import create_app

__all__ = ["create_app"]
