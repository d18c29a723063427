"""Request size limit: bodies over ``settings.max_body_bytes`` get a JSON 413.

A declared ``Content-Length`` over the limit is refused before the app runs; a chunked body is
counted as it arrives and refused (through the app's HTTPException handler) when it passes
the limit. Either way nothing is parsed or written.
"""

from __future__ import annotations

from fastapi import HTTPException
from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    def _too_large(self) -> str:
        return f"the request body is larger than {self.max_body_bytes} bytes (AUTOTUNER_MAX_BODY_BYTES)"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            await JSONResponse({"detail": self._too_large()}, status_code=413)(scope, receive, send)
            return
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:
                    raise HTTPException(413, self._too_large())
            return message

        await self.app(scope, limited, send)
