"""ONNX Runtime's run side: ``executor`` loads and runs an engine, ``custom_ops`` is the
session's custom-op adapter; its key rules are ``schemas.technologies.onnxruntime``. The build
side mirrors this folder in ``compiler_worker.backends.onnxruntime``."""

from runtime_agent.executors.onnxruntime.executor import ENGINE_MEDIA_TYPE, OnnxRuntimeExecutor

__all__ = ["ENGINE_MEDIA_TYPE", "OnnxRuntimeExecutor"]
