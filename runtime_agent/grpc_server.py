"""The Open Inference Protocol's gRPC service, ``inference.GRPCInferenceService``, over the
agent's model table (the same models, metrics and token as the REST server).

Its code is generated from ``runtime_agent/protocol/grpc_predict_v2.proto`` (the command is
in that file). The agent runs it on ``KILN_AGENT_GRPC_PORT`` (0, the default: no gRPC
server). With a serve token, every call but ``ServerLive`` and ``ServerReady`` needs the
metadata ``authorization: Bearer <token>``. A ``KilnError`` becomes the status of its code:
a bad request ``INVALID_ARGUMENT``, a missing model ``NOT_FOUND``; a message over the body
limit is refused by gRPC itself with ``RESOURCE_EXHAUSTED``.
"""

from __future__ import annotations

import functools
import hmac
import logging
import time
from collections.abc import Callable
from concurrent import futures
from typing import Any

import grpc
import numpy as np
from google.protobuf import json_format

from runtime_agent import inference, oip
from runtime_agent.inference import Metrics
from runtime_agent.protocol import grpc_predict_v2_pb2 as pb
from runtime_agent.protocol import grpc_predict_v2_pb2_grpc as pb_grpc
from runtime_agent.serving import ModelTable
from schemas.errors import ConfigError, ErrorCode, InvalidRequest, KilnError

logger = logging.getLogger(__name__)

_SERVICE = "/inference.GRPCInferenceService/"
_PROBES = frozenset({_SERVICE + "ServerLive", _SERVICE + "ServerReady"})
_STATUS = {
    ErrorCode.INVALID_REQUEST: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorCode.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    ErrorCode.MODEL_TOO_LARGE: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorCode.PAYLOAD_TOO_LARGE: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorCode.UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
}
#: Protocol datatype → the typed field of ``InferTensorContents`` that carries it (FP16 and
#: BF16 have none: they travel in ``raw_input_contents``).
_CONTENTS = {
    "BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents",
    "INT32": "int_contents", "INT64": "int64_contents", "UINT8": "uint_contents",
    "UINT16": "uint_contents", "UINT32": "uint_contents", "UINT64": "uint64_contents",
    "FP32": "fp32_contents", "FP64": "fp64_contents",
}


def _protocol_errors(method: Callable[..., Any]) -> Callable[..., Any]:
    """A ``KilnError`` raised by ``method`` aborts the call with its code's status."""

    @functools.wraps(method)
    def wrapper(self, request, context):
        try:
            return method(self, request, context)
        except KilnError as exc:
            status = _STATUS.get(exc.code, grpc.StatusCode.INTERNAL)
            if status is grpc.StatusCode.INTERNAL:
                logger.error("%s failed: %s", method.__name__, exc.message)
            context.abort(status, exc.message)

    return wrapper


class InferenceServicer(pb_grpc.GRPCInferenceServiceServicer):
    """``GRPCInferenceService`` over ``table``; thin over ``runtime_agent.oip``."""

    def __init__(self, table: ModelTable, metrics: Metrics) -> None:
        self.table = table
        self.metrics = metrics

    def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=True)

    def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=bool(self.table.names()))

    def ModelReady(self, request, context):
        try:
            oip.resolve(self.table, request.name, request.version)
        except KilnError:
            return pb.ModelReadyResponse(ready=False)
        return pb.ModelReadyResponse(ready=True)

    def ServerMetadata(self, request, context):
        from runtime_agent.server import server_version

        return pb.ServerMetadataResponse(name=oip.SERVER_NAME, version=server_version(),
                                         extensions=oip.EXTENSIONS)

    @_protocol_errors
    def ModelMetadata(self, request, context):
        return pb.ModelMetadataResponse(
            **oip.metadata(oip.resolve(self.table, request.name, request.version)))

    @_protocol_errors
    def ModelConfig(self, request, context):
        config = oip.model_config(oip.resolve(self.table, request.name, request.version))
        return pb.ModelConfigResponse(config=json_format.ParseDict(config, pb.ModelConfig()))

    @_protocol_errors
    def ModelStatistics(self, request, context):
        return json_format.ParseDict(oip.statistics(self.table, request.name, request.version),
                                     pb.ModelStatisticsResponse())

    @_protocol_errors
    def ModelInfer(self, request, context):
        started = time.perf_counter()
        model = oip.resolve(self.table, request.model_name, request.model_version)

        def decode() -> dict[str, np.ndarray]:
            names = [tensor.name for tensor in request.inputs]
            oip.check_unique(names, "input")
            raw = request.raw_input_contents
            if raw and len(raw) != len(request.inputs):
                raise InvalidRequest(f"raw_input_contents has {len(raw)} entries; the request "
                                     f"names {len(request.inputs)} inputs {names}")
            feed = {}
            for index, tensor in enumerate(request.inputs):
                shape = list(tensor.shape)
                if raw:
                    feed[tensor.name] = oip.from_raw(model, tensor.name, tensor.datatype,
                                                     shape, raw[index])
                    continue
                field = _CONTENTS.get(tensor.datatype)
                if field is None:
                    raise InvalidRequest(
                        f"input {tensor.name!r}: datatype {tensor.datatype!r} has no typed "
                        f"contents field; send it in raw_input_contents")
                feed[tensor.name] = oip.from_values(model, tensor.name, tensor.datatype, shape,
                                                    list(getattr(tensor.contents, field)))
            return feed

        wanted = [output.name for output in request.outputs]
        oip.check_unique(wanted, "output")
        names = oip.requested_outputs(model, wanted)
        outputs = inference.run(model, decode, self.metrics, started=started)
        response = pb.ModelInferResponse(model_name=model.name,
                                         model_version=model.artifact_id, id=request.id)
        for name in names:
            array = np.ascontiguousarray(outputs[name])
            response.outputs.add(name=name, datatype=oip.datatype_of(array.dtype),
                                 shape=list(array.shape))
            response.raw_output_contents.append(array.tobytes())
        return response


class _TokenInterceptor(grpc.ServerInterceptor):
    """Refuses every call but the health probes without ``authorization: Bearer <token>``."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

        def deny(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED,
                          "this agent's inference server needs the metadata 'authorization: "
                          "Bearer <token>' (the agent's KILN_AGENT_SERVE_TOKEN)")

        self._deny = grpc.unary_unary_rpc_method_handler(deny)

    def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method in _PROBES:
            return continuation(handler_call_details)
        given: str | bytes = ""
        for key, value in handler_call_details.invocation_metadata or ():
            if key == "authorization":
                given = value
                break
        given = given.encode() if isinstance(given, str) else given
        if hmac.compare_digest(given, self._expected):
            return continuation(handler_call_details)
        return self._deny


class GrpcServer:
    """The gRPC inference server: ``start()`` binds and serves in gRPC's threads."""

    def __init__(self, table: ModelTable, metrics: Metrics, host: str, port: int, *,
                 token: str | None = None, max_message_bytes: int = 64 * 1024 * 1024,
                 workers: int = 8) -> None:
        self.host, self.port = host, port
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kiln-grpc"),
            interceptors=[_TokenInterceptor(token)] if token else [],
            options=[("grpc.max_receive_message_length", max_message_bytes),
                     ("grpc.max_send_message_length", max_message_bytes)],
        )
        pb_grpc.add_GRPCInferenceServiceServicer_to_server(
            InferenceServicer(table, metrics), self._server)

    def start(self) -> None:
        """Start serving; ``ConfigError`` when the port cannot be bound."""
        address = f"[{self.host}]:{self.port}" if ":" in self.host else \
            f"{self.host}:{self.port}"
        try:
            bound = self._server.add_insecure_port(address)
        except RuntimeError as exc:
            raise ConfigError(f"the gRPC server could not listen on {address}: {exc}; choose "
                              f"another port (KILN_AGENT_GRPC_PORT, or 0 for none)") from exc
        if not bound:
            raise ConfigError(f"the gRPC server could not listen on {address}; choose another "
                              f"port (KILN_AGENT_GRPC_PORT, or 0 for none)")
        self.port = bound
        self._server.start()
        logger.info("gRPC (Open Inference Protocol) listening on %s:%d", self.host, bound)

    def stop(self, grace_s: float = 5.0) -> None:
        self._server.stop(grace_s).wait(grace_s + 1)
