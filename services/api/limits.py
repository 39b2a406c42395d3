"""An ASGI middleware that refuses request bodies over a size limit while they stream in,
so an oversized upload is rejected with 413 before it fills a disk."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from schemas.errors import ErrorBody, ErrorCode


class BodyTooLarge(Exception):
    pass


class BodySizeLimit:
    def __init__(self, app: ASGIApp, *, max_bytes: int, slack_bytes: int = 64 * 1024) -> None:
        self.app = app
        self.max_bytes = max_bytes
        #: Room for multipart framing on top of the payload itself.
        self.hard_limit = max_bytes + slack_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.hard_limit:
            await self._reject(send, int(declared))
            return

        seen = 0
        started = False

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.hard_limit:
                    raise BodyTooLarge
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except BodyTooLarge:
            if not started:
                await self._reject(send, seen)

    async def _reject(self, send: Send, size: int) -> None:
        body = ErrorBody(
            code=ErrorCode.MODEL_TOO_LARGE,
            message=f"request body of at least {size} bytes is over the limit of "
            f"{self.max_bytes} bytes (KILN_MAX_UPLOAD_BYTES)",
            details={"limit_bytes": self.max_bytes},
        ).model_dump_json().encode()
        await send({
            "type": "http.response.start",
            "status": 413,
            "headers": [(b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode()),
                        (b"connection", b"close")],
        })
        await send({"type": "http.response.body", "body": body})
