"""Tuning records: the tuner's candidate table per cache key (model, options digest,
fingerprint key, toolchain).

Keyed by exactly what invalidates a tuning result: a lookup with another fingerprint key (a
new chip variant) or another toolchain is a miss, never a neighbour's winner.
"""

from __future__ import annotations

import logging

import sqlalchemy as sa
from sqlalchemy.orm import Session

from schemas.errors import InvalidRequest
from schemas.tuning import TuningRecordInfo, TuningTable
from services.db.repo._common import _check_limit, _insert, _require_artifact, _require_model
from services.db.tables import TuningRecordRow, utcnow

log = logging.getLogger(__name__)


def _record(row: TuningRecordRow) -> TuningRecordInfo:
    return TuningRecordInfo(
        model_id=row.model_id,
        options_digest=row.options_digest,
        fingerprint_key=row.fingerprint_key,
        toolchain=row.toolchain,
        winner=row.winner,
        winner_config=dict(row.winner_config or {}),
        table=TuningTable.model_validate(row.tuning_table),
        created_at=row.created_at,
    )


def _winner_config(table: TuningTable) -> dict[str, object]:
    if table.winner is None:
        return {}
    try:
        return dict(table.candidate(table.winner).config)
    except KeyError as exc:
        raise InvalidRequest(
            f"the tuning table names winner {table.winner!r}, which is not one of its "
            f"candidates {[c.name for c in table.candidates]}", winner=table.winner,
        ) from exc


def record_tuning(
    session: Session,
    *,
    model_id: str,
    options_digest: str,
    fingerprint_key: str,
    toolchain: str,
    table: TuningTable,
) -> TuningRecordInfo:
    """Keep ``table`` as the tuning record of this cache key (an upsert; recording the same
    table again changes nothing).

    A table that searched replaces the one recorded; a table that only ``reused`` the recorded
    winner does not overwrite the search it came from. ``InvalidRequest`` when the table is for
    another fingerprint key or toolchain than the key, or names a winner it does not list;
    ``NotFound`` for an unknown model.
    """
    if (table.fingerprint_key, table.toolchain) != (fingerprint_key, toolchain):
        raise InvalidRequest(
            f"the tuning table is for fingerprint key {table.fingerprint_key!r} and toolchain "
            f"{table.toolchain!r}, not {fingerprint_key!r} and {toolchain!r}",
            fingerprint_key=fingerprint_key, toolchain=toolchain,
        )
    winner_config = _winner_config(table)
    key = (model_id, options_digest, fingerprint_key, toolchain)
    row = session.get(TuningRecordRow, key, with_for_update=True)
    if row is None:
        _require_model(session, model_id)
        row, created = _insert(
            session,
            TuningRecordRow(model_id=model_id, options_digest=options_digest,
                            fingerprint_key=fingerprint_key, toolchain=toolchain,
                            winner=table.winner, winner_config=winner_config,
                            tuning_table=table.model_dump(mode="json"), created_at=utcnow()),
            lambda: session.get(TuningRecordRow, key),
        )
        if created:
            log.info("recorded tuning for %s: winner %s of %d candidates", key, table.winner,
                     len(table.candidates))
            return _record(row)
    recorded = TuningTable.model_validate(row.tuning_table)
    if recorded == table or (table.reused and not recorded.reused):
        return _record(row)
    row.winner = table.winner
    row.winner_config = winner_config
    row.tuning_table = table.model_dump(mode="json")
    row.created_at = utcnow()
    session.flush()
    log.info("replaced tuning for %s: winner %s", key, table.winner)
    return _record(row)


def find_tuning(
    session: Session, *, model_id: str, options_digest: str, fingerprint_key: str,
    toolchain: str,
) -> TuningTable | None:
    """The recorded table for exactly this cache key, or ``None``."""
    row = session.get(TuningRecordRow, (model_id, options_digest, fingerprint_key, toolchain))
    return TuningTable.model_validate(row.tuning_table) if row is not None else None


def list_tuning(
    session: Session, *, model_id: str | None = None, artifact_id: str | None = None,
    limit: int = 100,
) -> list[TuningRecordInfo]:
    """Tuning records, newest first: one model's, or the one recorded for an artifact's cache
    key (``NotFound`` for an unknown artifact or model)."""
    _check_limit(limit)
    stmt = sa.select(TuningRecordRow)
    if model_id is not None:
        _require_model(session, model_id)
        stmt = stmt.where(TuningRecordRow.model_id == model_id)
    if artifact_id is not None:
        artifact = _require_artifact(session, artifact_id)
        stmt = stmt.where(
            TuningRecordRow.model_id == artifact.model_id,
            TuningRecordRow.options_digest == artifact.options_digest,
            TuningRecordRow.fingerprint_key == artifact.fingerprint_key,
            TuningRecordRow.toolchain == artifact.toolchain,
        )
    stmt = stmt.order_by(TuningRecordRow.created_at.desc(), TuningRecordRow.fingerprint_key)
    return [_record(row) for row in session.scalars(stmt.limit(limit))]
