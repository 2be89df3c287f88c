"""The AIS ETL service: ``transformer.server:app`` is the ASGI app, configured from the environment."""

from .app import create_app

app = create_app()

__all__ = ["app", "create_app"]
