"""AOTInductor's run side: ``executor`` loads and runs a ``.pt2`` package, ``custom_ops``
registers the plugins' ops with ``torch.library``; its key rules are
``schemas.technologies.aotinductor``. The build side mirrors this folder in
``compiler_worker.backends.aotinductor``."""

from runtime_agent.executors.aotinductor.executor import ENGINE_MEDIA_TYPE, AOTInductorExecutor

__all__ = ["ENGINE_MEDIA_TYPE", "AOTInductorExecutor"]
