"""What a retention pass (``kiln gc``) deleted, or would delete on a dry run."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, ConfigDict, Field


class RetentionArtifact(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str
    model_id: str
    fingerprint_key: str
    size_bytes: int
    created_at: datetime
    #: Why it may go.
    reason: str


class RetentionReport(BaseModel):
    model_config = ConfigDict(extra="forbid")

    #: True: nothing was deleted; the lists say what a real pass would delete.
    dry_run: bool
    artifacts: list[RetentionArtifact] = Field(default_factory=list)
    #: Artifacts past the per-key count that stay because a deployment or an agent uses them.
    kept_in_use: int = 0
    #: Finished jobs deleted (older than the job retention).
    jobs: int = 0
    #: Agents forgotten (silent for longer than the agent retention).
    agents: list[str] = Field(default_factory=list)
    #: Revoked-token rows past their token's own expiry.
    revoked_tokens: int = 0
    #: Blobs removed from the store (sha256), referenced by nothing left. Empty on a dry run:
    #: which blobs go is known only once the rows are gone.
    blobs: list[str] = Field(default_factory=list)
    freed_bytes: int = 0
    #: Store deletions that failed; their bytes are orphans `kiln store verify` reports.
    store_errors: list[str] = Field(default_factory=list)
