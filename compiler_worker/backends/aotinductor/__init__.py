"""AOTInductor's build side: ``backend`` (candidates and build). Its run side mirrors this
folder in ``runtime_agent.executors.aotinductor``."""

from compiler_worker.backends.aotinductor.backend import AOTInductorBackend

__all__ = ["AOTInductorBackend"]
