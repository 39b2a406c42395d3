"""Revoked API tokens: a token whose ``jti`` is here answers 401 until it expires anyway."""

from __future__ import annotations

from datetime import UTC, datetime

import sqlalchemy as sa
from sqlalchemy.orm import Session

from schemas.errors import InvalidRequest
from services.db.repo._common import _insert
from services.db.tables import RevokedTokenRow, utcnow

JTI_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"


def revoke_token(session: Session, *, jti: str, expires_at: int | None = None,
                 reason: str = "") -> bool:
    """Revoke ``jti`` (idempotent). Returns whether it was newly revoked. Expired rows are
    pruned on the way: an expired token is refused by its ``exp`` already."""
    import re

    if not re.match(JTI_PATTERN, jti):
        raise InvalidRequest(f"a token id (jti) matches {JTI_PATTERN}; got {jti!r}")
    session.execute(sa.delete(RevokedTokenRow).where(RevokedTokenRow.expires_at < utcnow()))
    if session.get(RevokedTokenRow, jti) is not None:
        return False
    expiry = datetime.fromtimestamp(expires_at, UTC) if expires_at is not None else None
    _, created = _insert(session, RevokedTokenRow(jti=jti, revoked_at=utcnow(),
                                                  expires_at=expiry, reason=reason[:200]),
                         lambda: session.get(RevokedTokenRow, jti))
    return created


def token_revoked(session: Session, *, jti: str) -> bool:
    return session.get(RevokedTokenRow, jti) is not None


def revoked_jtis(session: Session) -> frozenset[str]:
    """The ids of the revoked tokens that have not expired yet (a short list: a row goes once
    its token would have expired anyway)."""
    rows = session.scalars(sa.select(RevokedTokenRow.jti).where(sa.or_(
        RevokedTokenRow.expires_at.is_(None), RevokedTokenRow.expires_at >= utcnow())))
    return frozenset(rows)
