"""The dashboard's static files: plotly.js from the installed ``plotly`` package (the machine
may have no internet, so never a CDN) and our own CSS/JS.

Each app's :class:`Assets` (``ServiceState.assets``) reads a file on its first request and
serves it from memory after, with a strong ETag (``304`` on ``If-None-Match``),
``Cache-Control`` and, when the client accepts it, gzip (plotly.min.js is ~4.8 MB, ~1.4 MB
gzipped). Pages link them with ``?v=VERSION`` so an upgrade is fetched anew.
"""

from __future__ import annotations

import gzip
import hashlib
from dataclasses import dataclass
from importlib import metadata, resources
from pathlib import Path

__all__ = ["ASSETS", "Asset", "Assets", "plotly_version"]

_HERE = Path(__file__).resolve().parent / "static"
_TYPES = {".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8"}
CACHE_CONTROL = "public, max-age=604800"  # a week; URLs carry ?v=


def _plotly_js() -> Path:
    path = resources.files("plotly") / "package_data" / "plotly.min.js"
    return Path(str(path))


# name under /static/ -> where the file is
ASSETS = {
    "plotly.min.js": _plotly_js,
    "dashboard.js": lambda: _HERE / "dashboard.js",
    "dashboard.css": lambda: _HERE / "dashboard.css",
}


def plotly_version() -> str:
    try:
        return metadata.version("plotly")
    except metadata.PackageNotFoundError:  # pragma: no cover
        return "0"


@dataclass(frozen=True)
class Asset:
    body: bytes
    gzipped: bytes
    etag: str
    media_type: str


def _load(path: Path) -> Asset:
    body = path.read_bytes()
    digest = hashlib.sha256(body).hexdigest()[:32]
    return Asset(body=body, gzipped=gzip.compress(body, compresslevel=6, mtime=0),
                 etag=f'"{digest}"', media_type=_TYPES.get(path.suffix, "application/octet-stream"))


class Assets:
    """The static files of one app, each read and gzipped once; ``version`` goes in their URLs."""

    def __init__(self) -> None:
        self.version = plotly_version()
        self._loaded: dict[str, Asset] = {}

    def get(self, name: str) -> Asset | None:
        """The named static file, or None for an unknown name."""
        found = self._loaded.get(name)
        if found is None:
            locate = ASSETS.get(name)
            if locate is None:
                return None
            found = self._loaded[name] = _load(locate())
        return found
