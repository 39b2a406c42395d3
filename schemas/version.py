"""Kiln's own version, for provenance and the API."""

from __future__ import annotations

from importlib import metadata

try:
    KILN_VERSION = metadata.version("kiln")
except metadata.PackageNotFoundError:  # running from a source tree that is not installed
    KILN_VERSION = "0.0.0+source"
