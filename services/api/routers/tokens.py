"""``/v1/tokens``: revoking API tokens before they expire (``kiln token revoke JTI``)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from services.api.deps import AdminPrincipal, Route, SessionDep
from services.db import repo
from services.db.repo.tokens import JTI_PATTERN

router = APIRouter(prefix="/v1/tokens", tags=["tokens"], route_class=Route)


class TokenRevocation(BaseModel):
    model_config = ConfigDict(extra="forbid")

    #: The token's id: its ``jti`` claim (``kiln token create`` prints it).
    jti: str = Field(pattern=JTI_PATTERN)
    #: The token's expiry (Unix seconds), when known: the row can go once it passes.
    expires_at: int | None = Field(None, ge=0)
    reason: str = Field("", max_length=200)


class TokenRevoked(BaseModel):
    jti: str
    #: False when it was revoked already.
    newly_revoked: bool


@router.post("/revoked", response_model=TokenRevoked)
def revoke_token(revocation: TokenRevocation, session: SessionDep,
                 _: AdminPrincipal, request: Request) -> TokenRevoked:
    """Revoke a token by its ``jti``: from now on it answers 401 (``revoked``) from this API
    process, and from other replicas within ``KILN_REVOCATION_REFRESH_S``. Idempotent."""
    created = repo.revoke_token(session, jti=revocation.jti, expires_at=revocation.expires_at,
                                reason=revocation.reason)
    session.commit()
    request.app.state.revocations.add(revocation.jti)
    return TokenRevoked(jti=revocation.jti, newly_revoked=created)
