"""Blob stores behind one small interface, chosen by URI scheme.

``open_store("file:///abs/dir")`` or ``open_store("s3://bucket/prefix")`` returns an
``ArtifactStore``: content-addressed blobs (sha256) and signed manifests.
"""

from artifact_store.base import ArtifactStore
from artifact_store.registry import get, open_store, register
from artifact_store.signing import Signer, Verifier, generate_keypair, load_signer, load_verifier

__all__ = [
    "ArtifactStore",
    "Signer",
    "Verifier",
    "generate_keypair",
    "get",
    "load_signer",
    "load_verifier",
    "open_store",
    "register",
]
