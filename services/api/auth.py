"""Bearer tokens: HS256 JWTs signed with ``KILN_SECRET_KEY``, carrying a role, an expiry
(``exp``) and an id (``jti``) that an admin can revoke.

Roles: ``admin`` (everything), ``reader`` (reads models, artifacts, jobs and the fleet: the
dashboard's viewers), ``worker`` and ``agent`` (read models and artifacts, report state).
An agent token also names the one agent it speaks for (the ``agent`` claim); a worker token
names the fingerprint keys it may build (the ``keys`` claim, each with its tuning contexts
``K-t-…``; ``*``: any key, what the embedded stack gives its own workers). ``kiln token``
mints tokens; ``kiln token revoke JTI`` revokes one.
"""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import Callable
from enum import StrEnum

import jwt
from pydantic import BaseModel, ConfigDict

from schemas.agents import AGENT_NAME_PATTERN
from schemas.errors import Forbidden, InvalidRequest, Unauthenticated
from schemas.fingerprint import is_context_key_of

ISSUER = "kiln"
#: Lifetime of a token minted without one given (``KILN_TOKEN_TTL_S``'s default), seconds.
DEFAULT_TOKEN_TTL_S = 30 * 24 * 3600
#: Clock skew tolerated on ``exp`` and ``iat``, seconds.
LEEWAY_S = 30
_REQUIRED = ["sub", "iat", "iss", "exp", "jti", "role"]
#: Verified tokens each process keeps (``_verified``).
TOKEN_CACHE_SIZE = 16384
#: A worker token's ``keys`` entry admitting every fingerprint key.
ANY_KEY = "*"
#: Most fingerprint keys one worker token may name.
MAX_WORKER_KEYS = 64


class Role(StrEnum):
    ADMIN = "admin"
    READER = "reader"
    WORKER = "worker"
    AGENT = "agent"


class Principal(BaseModel):
    model_config = ConfigDict(frozen=True)  # one instance answers every request of a token

    subject: str
    role: Role
    #: The token's id (what ``kiln token revoke`` names).
    jti: str
    #: Unix time the token expires.
    expires_at: int
    #: An agent token's agent: the only agent it may register or heartbeat as.
    agent: str | None = None
    #: A worker token's fingerprint keys: the only jobs it may claim, upload for and complete
    #: (``["*"]``: any key).
    keys: list[str] | None = None


def mint_token(secret: str, *, role: Role, subject: str, ttl_s: int,
               agent: str | None = None, keys: list[str] | None = None) -> str:
    """A token for ``role`` valid ``ttl_s`` seconds. An agent token needs ``agent`` (the name
    it will register under); a worker token needs ``keys`` (the fingerprint keys it builds,
    or ``["*"]``); other roles take neither."""
    import re

    from schemas.agents import FINGERPRINT_KEY_PATTERN

    if ttl_s <= 0:
        raise InvalidRequest(f"a token's lifetime must be positive seconds; got {ttl_s}")
    if role is Role.AGENT:
        if agent is None or not re.match(AGENT_NAME_PATTERN, agent):
            raise InvalidRequest(f"an agent token names its agent (matching "
                                 f"{AGENT_NAME_PATTERN}); got {agent!r}")
    elif agent is not None:
        raise InvalidRequest(f"only agent tokens name an agent; a {role.value} token may not")
    if role is Role.WORKER:
        if (not keys or len(keys) > MAX_WORKER_KEYS
                or not all(k == ANY_KEY or re.fullmatch(FINGERPRINT_KEY_PATTERN, k)
                           for k in keys)):
            raise InvalidRequest(f"a worker token names the fingerprint keys it builds (1 to "
                                 f"{MAX_WORKER_KEYS}, each matching {FINGERPRINT_KEY_PATTERN}, "
                                 f"or {ANY_KEY!r} for any); got {keys!r}")
    elif keys is not None:
        raise InvalidRequest(f"only worker tokens name fingerprint keys; a {role.value} token "
                             f"may not")
    now = int(time.time())
    claims: dict[str, object] = {"iss": ISSUER, "sub": subject, "role": role.value, "iat": now,
                                 "exp": now + ttl_s, "jti": uuid.uuid4().hex}
    if agent is not None:
        claims["agent"] = agent
    if keys is not None:
        claims["keys"] = sorted(set(keys))
    return jwt.encode(claims, secret, algorithm="HS256")


def decode_token(secret: str, authorization: str | None) -> Principal:
    """The principal of an ``Authorization`` header; ``Unauthenticated`` saying why not
    (missing, malformed, bad signature, expired). Revocation is checked by the caller."""
    if not authorization:
        raise Unauthenticated("missing credentials: send 'Authorization: Bearer <token>'")
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise Unauthenticated("expected 'Authorization: Bearer <token>'")
    principal = _verified(secret, token.strip())
    if principal.expires_at + LEEWAY_S < time.time():  # verified earlier, expired since
        raise Unauthenticated("token expired: mint a new one (`kiln token create`)",
                              reason="expired")
    return principal


@functools.lru_cache(maxsize=TOKEN_CACHE_SIZE)
def _verified(secret: str, token: str) -> Principal:
    """The principal of a token whose signature, issuer and claims verify. A token is sent
    on every request (10,000 agents heartbeat and long-poll with theirs), and verifying it
    again gives the same answer, so each process keeps the last ``TOKEN_CACHE_SIZE`` it
    verified; a failure is never kept. Expiry is the caller's to check each time, and
    revocation too."""
    try:
        claims = jwt.decode(
            token, secret, algorithms=["HS256"], issuer=ISSUER, leeway=LEEWAY_S,
            options={"require": _REQUIRED},
        )
    except jwt.ExpiredSignatureError as exc:
        raise Unauthenticated("token expired: mint a new one (`kiln token create`)",
                              reason="expired") from exc
    except jwt.MissingRequiredClaimError as exc:
        raise Unauthenticated(f"invalid token: {exc}; tokens carry {_REQUIRED} "
                              f"(mint a new one with `kiln token create`)",
                              reason="malformed") from exc
    except jwt.InvalidSignatureError as exc:
        raise Unauthenticated("invalid token: its signature does not verify with this API's "
                              "secret", reason="signature") from exc
    except jwt.PyJWTError as exc:
        raise Unauthenticated(f"invalid token: {exc}", reason="malformed") from exc
    try:
        role = Role(claims["role"])
    except ValueError as exc:
        raise Unauthenticated(f"invalid token: unknown role {claims['role']!r}; roles are "
                              f"{[r.value for r in Role]}", reason="malformed") from exc
    agent = claims.get("agent")
    if role is Role.AGENT and not isinstance(agent, str):
        raise Unauthenticated("invalid token: an agent token names its agent (the 'agent' "
                              "claim); mint one with `kiln token create --role agent --agent "
                              "NAME`", reason="malformed")
    keys = claims.get("keys")
    if role is Role.WORKER and not (isinstance(keys, list) and keys
                                    and all(isinstance(k, str) for k in keys)):
        raise Unauthenticated("invalid token: a worker token names the fingerprint keys it "
                              "builds (the 'keys' claim); mint one with `kiln token create "
                              "--role worker --key KEY`", reason="malformed")
    return Principal(subject=str(claims["sub"]), role=role, jti=str(claims["jti"]),
                     expires_at=int(claims["exp"]),
                     agent=agent if role is Role.AGENT else None,
                     keys=keys if role is Role.WORKER else None)


def authenticate(secret: str, authorization: str | None,
                 revoked: Callable[[str], bool] | None = None) -> Principal:
    """``decode_token``, then refuse a token whose ``jti`` ``revoked`` says is revoked."""
    principal = decode_token(secret, authorization)
    if revoked is not None and revoked(principal.jti):
        raise revoked_error(principal.jti)
    return principal


def revoked_error(jti: str) -> Unauthenticated:
    return Unauthenticated(f"token {jti} was revoked (`kiln token revoke`); mint a new one",
                           reason="revoked", jti=jti)


def require_role(principal: Principal, *roles: Role) -> Principal:
    if principal.role is Role.ADMIN or principal.role in roles:
        return principal
    allowed = [r.value for r in sorted({Role.ADMIN, *roles})]
    raise Forbidden(f"role {principal.role.value!r} may not do this; it needs one of {allowed}")


def check_agent(principal: Principal, name: str) -> None:
    """An agent token speaks only for the agent it names; admins for all."""
    if principal.role is Role.AGENT and principal.agent != name:
        raise Forbidden(f"this token speaks for agent {principal.agent!r}, not {name!r}; "
                        f"mint one with `kiln token create --role agent --agent {name}`")


def check_worker_key(principal: Principal, key: str) -> None:
    """A worker token acts only on jobs for the fingerprint keys it names, and the tuning
    contexts of those keys (``K-t-…``: the same hardware class, tuned for one node's context);
    admins on all."""
    keys = principal.keys or []
    if principal.role is Role.WORKER and ANY_KEY not in keys and key not in keys \
            and not any(is_context_key_of(key, k) for k in keys):
        raise Forbidden(f"this worker token builds {principal.keys}, not {key!r}; mint one "
                        f"with `kiln token create --role worker --key {key}`",
                        fingerprint_key=key, token_keys=principal.keys)
