"""Kiln: ahead-of-time compile farm and artifact store for ML models."""

__version__ = "0.1.0"
