"""TensorRT's build side: ``backend`` (candidates and build). Its run side mirrors this
folder in ``runtime_agent.executors.tensorrt``."""

from compiler_worker.backends.tensorrt.backend import TensorRTBackend

__all__ = ["TensorRTBackend"]
