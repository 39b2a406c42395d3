"""Custom-op plugins: content-addressed bundles, one immutable bundle per name and version."""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.orm import Session

from schemas.errors import Conflict, NotFound
from schemas.plugins import PluginInfo, PluginManifest, PluginRef, torch_op_name
from services.db.repo._common import _insert, _require_artifact
from services.db.tables import ArtifactRow, PluginRow, utcnow


def _plugin(row: PluginRow) -> PluginInfo:
    return PluginInfo(name=row.name, version=row.version, digest=row.digest,
                      size_bytes=row.size_bytes, ops=list(row.ops),
                      manifest=PluginManifest.model_validate(row.manifest),
                      created_at=row.created_at)


def record_plugin(
    session: Session, *, manifest: PluginManifest, digest: str, size_bytes: int
) -> tuple[PluginInfo, bool]:
    """Record bundle ``digest`` as plugin ``manifest.name`` ``manifest.version``.

    The same bundle again returns the existing row (created=False). A version is immutable:
    another bundle under a recorded name and version raises ``Conflict``.
    """
    def existing() -> PluginRow | None:
        return session.scalars(sa.select(PluginRow).where(
            PluginRow.name == manifest.name, PluginRow.version == manifest.version)).first()

    found = existing()
    if found is None:
        found, created = _insert(session, PluginRow(
            digest=digest, name=manifest.name, version=manifest.version, size_bytes=size_bytes,
            ops=[op.qualified_name for op in manifest.ops],
            manifest=manifest.model_dump(mode="json"), created_at=utcnow(),
        ), lambda: session.get(PluginRow, digest) or existing())
        if created:
            return _plugin(found), True
    if found.digest != digest:
        raise Conflict(
            f"plugin {manifest.name} {manifest.version} is already registered with another "
            f"bundle (sha256 {found.digest}); versions are immutable, publish a new version",
            name=manifest.name, version=manifest.version, digest=found.digest,
        )
    return _plugin(found), False


def get_plugin(session: Session, *, name: str, version: str) -> PluginInfo:
    row = session.scalars(sa.select(PluginRow).where(
        PluginRow.name == name, PluginRow.version == version)).first()
    if row is None:
        versions = session.scalars(sa.select(PluginRow.version).where(PluginRow.name == name))
        raise NotFound(f"no plugin {name} {version}; registered versions of {name}: "
                       f"{sorted(versions)}", plugin=name, version=version)
    return _plugin(row)


def list_plugins(session: Session) -> list[PluginInfo]:
    stmt = sa.select(PluginRow).order_by(PluginRow.name, PluginRow.created_at.desc())
    return [_plugin(row) for row in session.scalars(stmt)]


def plugins_current(session: Session, *, artifact_id: str) -> bool:
    """Whether every plugin the artifact was built with is still the newest one providing its
    ops (a newer plugin version makes the artifact stale for new compile requests)."""
    # Asked for every deployment on every agent heartbeat: read the recorded refs only,
    # without validating the whole manifest.
    return refs_current(session, _require_artifact(session, artifact_id).manifest)


def plugins_current_many(session: Session, *, artifact_ids: list[str]) -> dict[str, bool]:
    """``plugins_current`` for several artifacts, reading their recorded refs in one query
    (an unknown id is absent from the answer)."""
    if not artifact_ids:
        return {}
    stmt = sa.select(ArtifactRow.id, ArtifactRow.manifest).where(
        ArtifactRow.id.in_(sorted(set(artifact_ids))))
    return {artifact_id: refs_current(session, recorded)
            for artifact_id, recorded in session.execute(stmt)}


def refs_current(session: Session, recorded: dict | None) -> bool:
    """Whether the plugins a recorded manifest (JSON) names are each still the newest one
    providing its ops."""
    refs = (recorded or {}).get("plugins") or []
    for ref in map(PluginRef.model_validate, refs):
        row = session.get(PluginRow, ref.digest)
        if row is None:
            return False
        newest = plugins_for_ops(session, ops=set(row.ops))
        if any(info.digest != ref.digest for info in newest.values()):
            return False
    return True


def plugins_for_ops(session: Session, *, ops: set[str]) -> dict[str, PluginInfo]:
    """For each ``domain::OpType`` in ``ops``, the newest plugin declaring it (ops no plugin
    declares are absent from the result). An op may also be asked for by its PyTorch name
    (``schemas.plugins.torch_op_name``: a torch program names ``kiln_examples::Swish`` what a
    plugin declares as ``kiln.examples::Swish``)."""
    found: dict[str, PluginInfo] = {}
    stmt = sa.select(PluginRow).order_by(PluginRow.created_at.desc(), PluginRow.digest)
    for row in session.scalars(stmt):
        declared = set(row.ops) | {torch_op_name(op) for op in row.ops}
        for op in declared & ops:
            found.setdefault(op, _plugin(row))
    return found
