"""TensorRT's run side: ``executor`` deserializes and runs a plan; its key rules are
``schemas.technologies.tensorrt``. The build side mirrors this folder in
``compiler_worker.backends.tensorrt``."""

from runtime_agent.executors.tensorrt.executor import ENGINE_MEDIA_TYPE, TensorRTExecutor

__all__ = ["ENGINE_MEDIA_TYPE", "TensorRTExecutor"]
