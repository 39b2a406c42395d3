"""Stores by URI scheme: a tiny registry (``register``, ``get``) and ``open_store``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from urllib.parse import SplitResult, unquote, urlsplit

from artifact_store.base import ArtifactStore
from schemas.errors import ConfigError

#: Builds a store from a parsed URI and the keyword options of ``open_store``.
StoreFactory = Callable[..., ArtifactStore]

_factories: dict[str, StoreFactory] = {}


def register(scheme: str, factory: StoreFactory) -> None:
    """Register ``factory`` for URIs ``<scheme>://...``; a scheme registers once."""
    if scheme in _factories:
        raise ConfigError(
            f"an artifact store is already registered for scheme {scheme!r} "
            f"({_factories[scheme]!r})"
        )
    _factories[scheme] = factory


def get(scheme: str) -> StoreFactory:
    """The factory for ``scheme``; ``ConfigError`` listing the known schemes otherwise."""
    try:
        return _factories[scheme]
    except KeyError:
        raise ConfigError(
            f"Could not find a registered artifact store for scheme {scheme!r}. "
            f"Currently registered schemes are: {', '.join(sorted(_factories))}",
            scheme=scheme,
            registered=sorted(_factories),
        ) from None


def open_store(
    uri: str, *, s3_endpoint_url: str | None = None, s3_region: str = "us-east-1",
    s3_public_endpoint_url: str | None = None, create: bool = False,
) -> ArtifactStore:
    """Open the store at ``uri``: ``file:///abs/dir`` or ``s3://bucket/prefix``. With
    ``create`` a missing bucket is created (a local folder always is)."""
    parsed = urlsplit(uri)
    return get(parsed.scheme)(parsed, s3_endpoint_url=s3_endpoint_url, s3_region=s3_region,
                              s3_public_endpoint_url=s3_public_endpoint_url, create=create)


def _open_local(parsed: SplitResult, **_options: object) -> ArtifactStore:
    from artifact_store.local import LocalStore

    if parsed.netloc not in ("", "localhost") or not parsed.path.startswith("/"):
        raise ConfigError(
            f"expected a file URI with an absolute path, file:///abs/dir; got {parsed.geturl()!r}"
        )
    return LocalStore(Path(unquote(parsed.path)))


def _open_s3(
    parsed: SplitResult, *, s3_endpoint_url: str | None, s3_region: str,
    s3_public_endpoint_url: str | None = None, create: bool = False, **_options: object
) -> ArtifactStore:
    from artifact_store.s3 import S3Store

    if not parsed.netloc:
        raise ConfigError(f"expected s3://<bucket>/<prefix>; got {parsed.geturl()!r}")
    return S3Store(
        parsed.netloc, unquote(parsed.path), endpoint_url=s3_endpoint_url, region=s3_region,
        public_endpoint_url=s3_public_endpoint_url, create=create,
    )


register("file", _open_local)
register("s3", _open_s3)
