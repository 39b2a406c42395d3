"""One exception hierarchy with error codes, and the one table from code to HTTP status.

Every failure Kiln reports — an HTTP 4xx, a failed job, a refused artifact — carries an
``ErrorCode``. Messages say what was expected and what is available.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from pydantic import BaseModel, Field


class ErrorCode(StrEnum):
    # request / input
    INVALID_REQUEST = "invalid_request"
    INVALID_MODEL = "invalid_model"
    MODEL_TOO_LARGE = "model_too_large"
    #: Any other body over its limit: a dataset, a plugin bundle, an engine blob, a JSON
    #: request, an inference request.
    PAYLOAD_TOO_LARGE = "payload_too_large"
    INVALID_OPTIONS = "invalid_options"
    NOT_FOUND = "not_found"
    CONFLICT = "conflict"
    #: An id prefix that matches more than one row; the details list the matches.
    AMBIGUOUS_ID = "ambiguous_id"
    UNAUTHENTICATED = "unauthenticated"
    FORBIDDEN = "forbidden"
    # compile pipeline
    MODEL_CHECK_FAILED = "model_check_failed"
    UNSUPPORTED_OPSET = "unsupported_opset"
    BUILD_FAILED = "build_failed"
    VERIFICATION_FAILED = "verification_failed"
    ACCURACY_GATE_FAILED = "accuracy_gate_failed"
    NO_VIABLE_CANDIDATE = "no_viable_candidate"
    BACKEND_UNAVAILABLE = "backend_unavailable"
    FINGERPRINT_MISMATCH = "fingerprint_mismatch"
    #: A declared fingerprint no machine has (AMX on aarch64, a level without its baseline).
    FINGERPRINT_INCONSISTENT = "fingerprint_inconsistent"
    UNKNOWN_OPERATOR = "unknown_operator"
    #: A standard operator a backend's converter cannot translate (``details["op"]``, e.g.
    #: ``aten::kthvalue``): that backend builds nothing for the model; others still may.
    UNSUPPORTED_OPERATOR = "unsupported_operator"
    PLUGIN_ERROR = "plugin_error"
    # sandboxed steps (parsing, building, plugin code): a limit ran out, or the child died
    RESOURCE_LIMIT = "resource_limit"
    TIMED_OUT = "timed_out"
    SANDBOX_CRASHED = "sandbox_crashed"
    # storage / integrity
    INTEGRITY_ERROR = "integrity_error"
    SIGNATURE_INVALID = "signature_invalid"
    #: Signed metadata that verifies but must not be acted on: a version lower than one
    #: already seen (rollback), expired, or naming another agent or model.
    METADATA_REFUSED = "metadata_refused"
    #: A document whose ``schema_version`` this Kiln cannot read (a newer major version).
    SCHEMA_UNSUPPORTED = "schema_unsupported"
    STORE_ERROR = "store_error"
    # infrastructure
    QUEUE_UNAVAILABLE = "queue_unavailable"
    #: The control plane's database refused or dropped the connection, or gave up on the
    #: statement (too many clients, a restart, a deadlock, a lock held): send it again.
    DATABASE_UNAVAILABLE = "database_unavailable"
    #: The worker building a job stopped heartbeating, as many times as a job may be tried.
    WORKER_LOST = "worker_lost"
    #: An operator cancelled the job.
    CANCELLED = "cancelled"
    #: A worker asked for a job it cannot have: another live worker builds it, it was
    #: cancelled, or it has finished (or just failed past its attempt limit).
    CLAIM_REFUSED = "claim_refused"
    CONFIG_ERROR = "config_error"
    #: A client could not reach the API (refused, reset, timed out); never sent by the API.
    API_UNREACHABLE = "api_unreachable"
    INTERNAL = "internal"


HTTP_STATUS: dict[ErrorCode, int] = {
    ErrorCode.INVALID_REQUEST: 400,
    ErrorCode.INVALID_MODEL: 422,
    ErrorCode.MODEL_TOO_LARGE: 413,
    ErrorCode.PAYLOAD_TOO_LARGE: 413,
    ErrorCode.INVALID_OPTIONS: 422,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.CONFLICT: 409,
    ErrorCode.AMBIGUOUS_ID: 409,
    ErrorCode.UNAUTHENTICATED: 401,
    ErrorCode.FORBIDDEN: 403,
    ErrorCode.MODEL_CHECK_FAILED: 422,
    ErrorCode.UNSUPPORTED_OPSET: 422,
    ErrorCode.BUILD_FAILED: 422,
    ErrorCode.VERIFICATION_FAILED: 422,
    ErrorCode.ACCURACY_GATE_FAILED: 422,
    ErrorCode.NO_VIABLE_CANDIDATE: 422,
    ErrorCode.BACKEND_UNAVAILABLE: 422,
    ErrorCode.FINGERPRINT_MISMATCH: 409,
    ErrorCode.FINGERPRINT_INCONSISTENT: 422,
    ErrorCode.UNKNOWN_OPERATOR: 422,
    ErrorCode.UNSUPPORTED_OPERATOR: 422,
    ErrorCode.PLUGIN_ERROR: 422,
    ErrorCode.RESOURCE_LIMIT: 413,
    ErrorCode.TIMED_OUT: 422,
    ErrorCode.SANDBOX_CRASHED: 422,
    ErrorCode.INTEGRITY_ERROR: 502,
    ErrorCode.SIGNATURE_INVALID: 502,
    ErrorCode.METADATA_REFUSED: 502,
    ErrorCode.SCHEMA_UNSUPPORTED: 502,
    ErrorCode.STORE_ERROR: 503,
    ErrorCode.QUEUE_UNAVAILABLE: 503,
    ErrorCode.DATABASE_UNAVAILABLE: 503,
    ErrorCode.WORKER_LOST: 503,
    ErrorCode.CANCELLED: 409,
    ErrorCode.CLAIM_REFUSED: 409,
    ErrorCode.CONFIG_ERROR: 500,
    ErrorCode.API_UNREACHABLE: 503,
    ErrorCode.INTERNAL: 500,
}


class ErrorBody(BaseModel):
    """What every error response and every failed job carries."""

    code: ErrorCode
    message: str
    details: dict[str, Any] = Field(default_factory=dict)


class KilnError(Exception):
    """Base of every error Kiln raises on purpose."""

    code: ErrorCode = ErrorCode.INTERNAL
    #: True when retrying the same work may succeed (a broker or store hiccup).
    transient: bool = False

    def __init__(self, message: str, *, code: ErrorCode | None = None, **details: Any) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code
        self.message = message
        self.details = details

    @property
    def http_status(self) -> int:
        return HTTP_STATUS[self.code]

    def to_body(self) -> ErrorBody:
        return ErrorBody(code=self.code, message=self.message, details=self.details)

    @classmethod
    def from_body(cls, body: ErrorBody) -> KilnError:
        return cls(body.message, code=body.code, **body.details)


class InvalidRequest(KilnError):
    code = ErrorCode.INVALID_REQUEST


class InvalidModel(KilnError):
    code = ErrorCode.INVALID_MODEL


class PayloadTooLarge(KilnError):
    """A body over its limit (the details name the limit)."""

    code = ErrorCode.PAYLOAD_TOO_LARGE


class ModelTooLarge(PayloadTooLarge):
    """A model over its limit: the upload, or what its archive unpacks to."""

    code = ErrorCode.MODEL_TOO_LARGE


class InvalidOptions(KilnError):
    code = ErrorCode.INVALID_OPTIONS


class NotFound(KilnError):
    code = ErrorCode.NOT_FOUND


class Conflict(KilnError):
    code = ErrorCode.CONFLICT


class AmbiguousId(KilnError):
    code = ErrorCode.AMBIGUOUS_ID


class Unauthenticated(KilnError):
    code = ErrorCode.UNAUTHENTICATED


class Forbidden(KilnError):
    code = ErrorCode.FORBIDDEN


class CompileError(KilnError):
    """A compile job failed for a reason that retrying will not change."""

    code = ErrorCode.BUILD_FAILED


class ModelCheckFailed(CompileError):
    code = ErrorCode.MODEL_CHECK_FAILED


class UnsupportedOpset(CompileError):
    code = ErrorCode.UNSUPPORTED_OPSET


class VerificationFailed(CompileError):
    code = ErrorCode.VERIFICATION_FAILED


class AccuracyGateFailed(CompileError):
    """No reduced-precision candidate met the accuracy gate the options asked for; the details
    carry the best figure reached."""

    code = ErrorCode.ACCURACY_GATE_FAILED


class NoViableCandidate(CompileError):
    """Every candidate engine failed to build or to verify; the details list each and why."""

    code = ErrorCode.NO_VIABLE_CANDIDATE


class BackendUnavailable(CompileError):
    code = ErrorCode.BACKEND_UNAVAILABLE


class FingerprintMismatch(CompileError):
    code = ErrorCode.FINGERPRINT_MISMATCH


class UnknownOperator(CompileError):
    """The model uses a custom op that no registered plugin provides."""

    code = ErrorCode.UNKNOWN_OPERATOR


class UnsupportedOperator(CompileError):
    """The model uses a standard operator that a backend's converter cannot translate (the
    ONNX exporter for a torch program, say); ``details["op"]`` names it, ``aten::kthvalue``."""

    code = ErrorCode.UNSUPPORTED_OPERATOR


class PluginError(KilnError):
    """A plugin cannot be used here: no implementation for this backend or device, an ABI
    that does not match the runtime, a shape function that raised."""

    code = ErrorCode.PLUGIN_ERROR


class ResourceLimit(KilnError):
    """A sandboxed step ran out of a limit: ``details["limit"]`` names it (``address_space``,
    ``cpu_time``, ``file_size``) and ``details["stage"]`` the step."""

    code = ErrorCode.RESOURCE_LIMIT


class TimedOut(KilnError):
    """A sandboxed step ran past its wall-clock limit and was stopped (``details["stage"]``)."""

    code = ErrorCode.TIMED_OUT


class SandboxCrashed(KilnError):
    """A sandboxed step died without an answer (a signal, an exit); the details name how and
    the stage, the message its last output."""

    code = ErrorCode.SANDBOX_CRASHED


class IntegrityError(KilnError):
    """Bytes whose size or sha256 differ from what the manifest promised."""

    code = ErrorCode.INTEGRITY_ERROR


class SignatureInvalid(KilnError):
    code = ErrorCode.SIGNATURE_INVALID


class MetadataRefused(KilnError):
    """Signed metadata refused for what it says (``reason``: ``rollback``, ``expired``,
    ``wrong_agent``, ``model_mismatch``)."""

    code = ErrorCode.METADATA_REFUSED


class SchemaUnsupported(KilnError):
    code = ErrorCode.SCHEMA_UNSUPPORTED


class StoreError(KilnError):
    code = ErrorCode.STORE_ERROR
    transient = True


class QueueUnavailable(KilnError):
    code = ErrorCode.QUEUE_UNAVAILABLE
    transient = True


class DatabaseUnavailable(KilnError):
    code = ErrorCode.DATABASE_UNAVAILABLE
    transient = True


class JobCancelled(KilnError):
    """An operator cancelled the job; whoever works on it stops."""

    code = ErrorCode.CANCELLED


class ClaimRefused(KilnError):
    """A worker's claim on a job the control plane will not give it: built by another live
    worker, cancelled, or finished. The details name the job's ``status`` (and its owner);
    a delivery refused this way builds nothing."""

    code = ErrorCode.CLAIM_REFUSED


class ConfigError(KilnError):
    code = ErrorCode.CONFIG_ERROR
