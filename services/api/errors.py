"""Every error leaves the API as an ``ErrorBody`` with the status from the one code table."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy import exc as sa_exc
from starlette.exceptions import HTTPException as StarletteHTTPException

from schemas.errors import DatabaseUnavailable, ErrorBody, ErrorCode, KilnError

logger = logging.getLogger(__name__)

#: What the database layer raises when the database refuses or drops a connection (PostgreSQL's
#: "too many clients", a restart), no pooled connection is free in time, or it gives up on a
#: statement (a deadlock, a lock timeout): the client may send the request again.
DATABASE_ERRORS = (sa_exc.OperationalError, sa_exc.TimeoutError)
#: Sent with every ``database_unavailable``.
RETRY_AFTER = {"Retry-After": "1"}


def database_unavailable(exc: Exception, where: str) -> DatabaseUnavailable:
    """The 503 for ``exc`` (one of ``DATABASE_ERRORS``). The driver's text names the server's
    address: it goes to the log (with ``where``), not to the client."""
    text = str(exc)
    logger.warning("%s: the database could not serve it: %s", where,
                   text.splitlines()[0] if text else type(exc).__name__)
    return DatabaseUnavailable(
        "the database could not serve this request (it refused or dropped the connection, "
        "or gave up on the statement); try again",
        reason=type(getattr(exc, "orig", None) or exc).__name__)

_HTTP_CODES = {
    401: ErrorCode.UNAUTHENTICATED,
    403: ErrorCode.FORBIDDEN,
    404: ErrorCode.NOT_FOUND,
    409: ErrorCode.CONFLICT,
    413: ErrorCode.PAYLOAD_TOO_LARGE,
}


def error_response(status: int, body: ErrorBody, headers: dict[str, str] | None = None):
    return JSONResponse(status_code=status, content=body.model_dump(mode="json"), headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(KilnError)
    async def _kiln_error(request: Request, exc: KilnError):
        if exc.http_status >= 500:
            logger.error("%s %s failed: %s", request.method, request.url.path, exc.message)
        headers = ({"WWW-Authenticate": "Bearer"} if exc.code is ErrorCode.UNAUTHENTICATED
                   else RETRY_AFTER if exc.code is ErrorCode.DATABASE_UNAVAILABLE else None)
        return error_response(exc.http_status, exc.to_body(), headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        problems = []
        for err in exc.errors():
            where = ".".join(str(p) for p in err.get("loc", ()))
            problems.append(f"{where}: {err.get('msg')}")
        body = ErrorBody(
            code=ErrorCode.INVALID_REQUEST,
            message="request did not validate: " + "; ".join(problems),
            details={"errors": [
                {"loc": list(e.get("loc", ())), "msg": e.get("msg"), "type": e.get("type")}
                for e in exc.errors()
            ]},
        )
        return error_response(422, body)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        code = getattr(exc, "code", None)  # the front door's BodyTooLarge names its own
        if not isinstance(code, ErrorCode):
            code = _HTTP_CODES.get(exc.status_code, ErrorCode.INVALID_REQUEST)
        return error_response(exc.status_code, ErrorBody(code=code, message=str(exc.detail)))

    async def _database_unavailable(request: Request, exc: Exception):
        error = database_unavailable(exc, f"{request.method} {request.url.path}")
        return error_response(error.http_status, error.to_body(), RETRY_AFTER)

    for error_class in DATABASE_ERRORS:
        app.add_exception_handler(error_class, _database_unavailable)

    @app.exception_handler(sa_exc.StatementError)
    async def _statement_error(request: Request, exc: sa_exc.StatementError):
        # A check run while SQLAlchemy prepares a statement (a JSON value holding a NUL:
        # ``services/db/session.py``) raises our error; SQLAlchemy wraps it.
        if isinstance(exc.orig, KilnError):
            return await _kiln_error(request, exc.orig)
        return await _unexpected(request, exc)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(
            500, ErrorBody(code=ErrorCode.INTERNAL, message="internal error; see the API log")
        )
