"""ONNX Runtime's build side: ``backend`` (candidates and build). Its run side mirrors this
folder in ``runtime_agent.executors.onnxruntime``."""

from compiler_worker.backends.onnxruntime.backend import OnnxRuntimeBackend

__all__ = ["OnnxRuntimeBackend"]
