"""IREE's build side: ``backend`` (candidates and build). Its run side mirrors this
folder in ``runtime_agent.executors.iree``."""

from compiler_worker.backends.iree.backend import IreeBackend

__all__ = ["IreeBackend"]
