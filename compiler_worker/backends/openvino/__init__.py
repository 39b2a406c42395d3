"""OpenVINO's build side: ``backend`` (candidates and build). Its run side mirrors this
folder in ``runtime_agent.executors.openvino``."""

from compiler_worker.backends.openvino.backend import OpenVinoBackend

__all__ = ["OpenVinoBackend"]
