"""The runtime agent's own error types, and reading an ``ErrorBody`` off an HTTP response."""

from __future__ import annotations

import httpx
from pydantic import ValidationError

from schemas.errors import ErrorBody, ErrorCode, KilnError


class ControlPlaneUnreachable(KilnError):
    """The control plane (or the store it redirects to) could not be reached; retry later."""

    code = ErrorCode.STORE_ERROR
    transient = True


class HealthCheckFailed(KilnError):
    """A freshly loaded engine failed its run on sample inputs; it is not served."""

    code = ErrorCode.VERIFICATION_FAILED


#: Statuses after which the same request may succeed.
RETRYABLE_STATUSES = frozenset({408, 425, 429, 500, 502, 503, 504})


def error_from_response(response: httpx.Response, what: str) -> KilnError:
    """The ``KilnError`` an error response carries (an ``ErrorBody``), else one describing it.

    ``response`` must have been read. Retryable statuses yield a transient error.
    """
    try:
        error = KilnError.from_body(ErrorBody.model_validate_json(response.content))
    except (ValidationError, ValueError):
        text = response.text[:500].strip()
        error = KilnError(f"{what} failed with HTTP {response.status_code}: {text}",
                          status=response.status_code)
    error.transient = response.status_code in RETRYABLE_STATUSES
    return error
