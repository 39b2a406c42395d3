"""OpenVINO's run side: ``executor`` imports and runs a compiled blob, ``custom_ops`` adds the
plugins' extensions to the ``Core``; its key rules are ``schemas.technologies.openvino``. The
build side mirrors this folder in ``compiler_worker.backends.openvino``."""

from runtime_agent.executors.openvino.executor import ENGINE_MEDIA_TYPE, OpenVinoExecutor

__all__ = ["ENGINE_MEDIA_TYPE", "OpenVinoExecutor"]
