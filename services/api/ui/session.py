"""The dashboard's session: the token in a cookie, and the CSRF token its forms carry."""

from __future__ import annotations

import hashlib
import hmac
import time

from starlette.responses import Response

from schemas.errors import Forbidden
from services.api.auth import Principal

#: Where the dashboard lives; the session cookie is sent and accepted under it only.
PREFIX = "/ui"
COOKIE = "kiln_ui"
LOGIN = f"{PREFIX}/login"
HOME = f"{PREFIX}/jobs"

#: Why a browser was sent back to the login page (the ``reason`` an ``Unauthenticated`` error
#: carries), in words. Only these codes travel in the URL, never a free text.
REASONS = {
    "missing": "Sign in with an API token.",
    "expired": "Your token expired. Mint a new one (`kiln token create --role reader`) and "
               "sign in again.",
    "revoked": "Your token was revoked (`kiln token revoke`). Sign in with another one.",
    "signature": "That token was not signed by this API's secret.",
    "malformed": "That is not a Kiln API token.",
}


def csrf_token(secret: str, principal: Principal) -> str:
    """The token every form of this session carries: bound to the session's API token (its
    ``jti``), so a page of one session cannot post as another, and nothing is stored."""
    return hmac.new(secret.encode(), f"kiln-ui-csrf:{principal.jti}".encode(),
                    hashlib.sha256).hexdigest()


def check_csrf(secret: str, principal: Principal, sent: str | None) -> None:
    if not sent or not hmac.compare_digest(sent, csrf_token(secret, principal)):
        raise Forbidden("this form's CSRF token is missing or belongs to another session; "
                        "reload the page and submit it again")


def set_session(response: Response, token: str, principal: Principal, *, secure: bool) -> None:
    response.set_cookie(COOKIE, token, max_age=max(1, principal.expires_at - int(time.time())),
                        path=PREFIX, httponly=True, samesite="strict", secure=secure)


def clear_session(response: Response) -> None:
    response.delete_cookie(COOKIE, path=PREFIX, httponly=True, samesite="strict")


def safe_next(target: str | None) -> str:
    """Where to go after signing in: a dashboard path, never another host."""
    if (target and (target == PREFIX or target.startswith(PREFIX + "/"))
            and "//" not in target and "\\" not in target):
        return target
    return HOME
