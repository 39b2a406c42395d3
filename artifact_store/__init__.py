"""Blob stores behind one small interface, chosen by URI scheme.

``artifact_store.registry.open_store("file:///abs/dir")`` or ``open_store("s3://bucket/prefix")``
returns an ``artifact_store.base.ArtifactStore``: content-addressed blobs (sha256) and signed
manifests (``artifact_store.signing``).

This package's own module imports nothing: every sandboxed child imports
``artifact_store.sandbox`` before it confines itself, and a re-export here would make each one
load the signing stack (securesystemslib, which imports boto3) that no child uses.
"""
