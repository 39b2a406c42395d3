"""Bearer tokens: HS256 JWTs signed with ``KILN_SECRET_KEY``, carrying a role.

Roles: ``admin`` (everything), ``worker`` and ``agent`` (read models and artifacts, report
state). ``kiln token`` mints the admin token of an embedded stack.
"""

from __future__ import annotations

import time
from enum import StrEnum

import jwt
from pydantic import BaseModel

from schemas.errors import Forbidden, Unauthenticated

ISSUER = "kiln"


class Role(StrEnum):
    ADMIN = "admin"
    WORKER = "worker"
    AGENT = "agent"


class Principal(BaseModel):
    subject: str
    role: Role


def mint_token(secret: str, *, role: Role, subject: str, ttl_s: int | None = None) -> str:
    now = int(time.time())
    claims: dict[str, object] = {"iss": ISSUER, "sub": subject, "role": role.value, "iat": now}
    if ttl_s is not None:
        claims["exp"] = now + ttl_s
    return jwt.encode(claims, secret, algorithm="HS256")


def authenticate(secret: str, authorization: str | None) -> Principal:
    if not authorization:
        raise Unauthenticated("missing credentials: send 'Authorization: Bearer <token>'")
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token:
        raise Unauthenticated("expected 'Authorization: Bearer <token>'")
    try:
        claims = jwt.decode(
            token.strip(), secret, algorithms=["HS256"], issuer=ISSUER,
            options={"require": ["sub", "iat", "iss"]},
        )
        return Principal(subject=claims["sub"], role=Role(claims["role"]))
    except (jwt.PyJWTError, KeyError, ValueError) as exc:
        raise Unauthenticated(f"invalid token: {exc}") from exc


def require_role(principal: Principal, *roles: Role) -> Principal:
    if principal.role is Role.ADMIN or principal.role in roles:
        return principal
    allowed = [r.value for r in sorted({Role.ADMIN, *roles})]
    raise Forbidden(f"role {principal.role.value!r} may not do this; it needs one of {allowed}")
