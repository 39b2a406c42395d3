"""Start-up checks of the control-plane processes (``kiln api``, ``kiln worker``): what they
need must exist and answer before they serve, and a failure names the fix instead of
surfacing later as a failed job."""

from __future__ import annotations

import logging
from urllib.parse import urlsplit, urlunsplit

from artifact_store.base import ArtifactStore
from artifact_store.registry import open_store
from artifact_store.signing import load_signer
from schemas.errors import ConfigError, KilnError
from services.config import KilnSettings, SharedSettings
from services.queue import broker_probe

logger = logging.getLogger(__name__)

#: Seconds the broker has to answer at start-up.
BROKER_TIMEOUT_S = 5.0


def redact_url(url: str) -> str:
    """``url`` without its password."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
    return urlunsplit(parts._replace(netloc=netloc))


def check_broker(settings: SharedSettings) -> None:
    """``ConfigError`` naming the fix unless the broker answers (the server-less filesystem
    broker is a local folder, made when the queue is configured: nothing to reach)."""
    url = settings.broker_url or ""
    if url.startswith("filesystem"):
        return
    try:
        broker_probe(settings, timeout_s=BROKER_TIMEOUT_S)()
    except Exception as exc:  # any transport failure: the process cannot queue or consume
        raise ConfigError(
            f"the broker at {redact_url(url)} does not answer ({type(exc).__name__}: {exc}); "
            f"start it (e.g. `docker compose up -d redis`), or fix KILN_BROKER_URL",
            broker=redact_url(url)) from exc


def check_store(settings: KilnSettings) -> ArtifactStore:
    """Open the store and read from it: ``ConfigError`` naming the fix for a missing bucket
    or folder (``kiln store init`` makes either), ``StoreError`` when it does not answer."""
    store = open_store(settings.store_uri, s3_endpoint_url=settings.s3_endpoint_url,
                       s3_region=settings.s3_region,
                       s3_public_endpoint_url=settings.s3_public_endpoint_url)
    try:
        store.ping()
    except KilnError as exc:
        raise ConfigError(f"{exc.message} (`kiln store init` creates and checks the store)",
                          store=settings.store_uri) from exc
    return store


def preflight(settings: KilnSettings, *, signing_key: bool = False) -> None:
    """Every check a process of the control plane runs before it serves: the broker, the
    store, and (for a process that signs) a private key only its owner can read."""
    check_broker(settings)
    check_store(settings)
    if signing_key:
        load_signer(settings.signing_key_path)
    logger.info("preflight passed: broker %s, store %s%s", redact_url(settings.broker_url or ""),
                settings.store_uri, ", signing key " + str(settings.signing_key_path)
                if signing_key else "")
