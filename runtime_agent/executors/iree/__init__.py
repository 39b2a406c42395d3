"""IREE's run side: ``executor`` runs a ``.vmfb`` module; its key rules are
``schemas.technologies.iree``. The build side mirrors this folder in
``compiler_worker.backends.iree``."""

from runtime_agent.executors.iree.executor import ENGINE_MEDIA_TYPE, IreeExecutor

__all__ = ["ENGINE_MEDIA_TYPE", "IreeExecutor"]
