"""Custom-op plugins: what a bundle declares, and how artifacts and the API refer to it.

A plugin bundle is a folder packed as a tar archive: ``plugin.json`` (a ``PluginManifest``)
plus the files it lists (Python modules, shared libraries). It is content-addressed: its
digest is the sha256 of the archive. Artifacts name the bundles they need by name, version
and digest (``PluginRef``), inside their signed manifest.

``plugin.json`` is versioned ``"MAJOR.MINOR"`` (``schemas._versioned``); the first bundles wrote
the integer ``1``, read as ``1.0``. 1.1 adds ``Implementation.frontends``: an OpenVINO extension
library names the model formats whose front end it has conversion rules for. A manifest that
uses it is written as 1.1; one that does not keeps the version it says.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from schemas import technologies
from schemas._versioned import parse_version, validate_versioned, version_field

PLUGIN_NAME_PATTERN = r"^[a-z0-9][a-z0-9._-]{0,63}$"
VERSION_PATTERN = r"^[0-9]+(\.[0-9]+){0,2}([.+-][0-9A-Za-z.-]+)?$"
SHA256_PATTERN = r"^[0-9a-f]{64}$"
#: The ``plugin.json`` version this code writes and reads (see the module docstring).
PLUGIN_SCHEMA_VERSION = "1.1"
#: Model formats an OpenVINO extension may have front-end conversion rules for.
Frontend = Literal["onnx", "torch-export"]
#: The backend an implementation is for when it names none.
DEFAULT_PLUGIN_BACKEND = technologies.default_plugin_backend()
#: ``module:function`` inside the bundle.
ENTRY_PATTERN = r"^[A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_]*$"


def qualified_op(domain: str, op_type: str) -> str:
    """``domain::OpType``; the default ONNX domain is written ``ai.onnx``."""
    return f"{domain or 'ai.onnx'}::{op_type}"


def torch_op_name(op: str) -> str:
    """``domain::OpType`` as PyTorch names the op (``torch.ops.<namespace>.<OpType>``): the
    domain's dots become underscores (``kiln.examples::Swish`` → ``kiln_examples::Swish``)."""
    domain, _, op_type = op.partition("::")
    return f"{domain.replace('.', '_')}::{op_type}"


class TensorArg(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    #: numpy dtype names this argument accepts ("float32", "int64", ...).
    dtypes: list[str] = Field(min_length=1)
    optional: bool = False


class AttributeSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    type: Literal["int", "float", "string", "ints", "floats"]
    #: ``None`` with ``required=False`` means "absent unless given".
    default: Any = None
    required: bool = False


class OpSpec(BaseModel):
    """One custom operator: its name, signature, attributes and device-free shape function."""

    model_config = ConfigDict(extra="forbid")

    domain: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.]+$")
    op_type: str = Field(min_length=1, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    since_version: int = Field(1, ge=1)
    inputs: list[TensorArg]
    outputs: list[TensorArg] = Field(min_length=1)
    attributes: list[AttributeSpec] = Field(default_factory=list)
    #: ``module:function(input_types, attributes) -> output_types``; see docs/custom-ops.md.
    #: Optional for ops whose implementation is native (the library brings its own).
    shape_function: str | None = Field(None, pattern=ENTRY_PATTERN)
    doc: str = ""

    @property
    def qualified_name(self) -> str:
        return qualified_op(self.domain, self.op_type)


class Implementation(BaseModel):
    """How one op (or, for a native library, several) runs on one backend and device."""

    model_config = ConfigDict(extra="forbid")

    #: ``domain::OpType`` of the ops this implements.
    ops: list[str] = Field(min_length=1)
    backend: str = DEFAULT_PLUGIN_BACKEND
    device: str = "cpu"
    kind: Literal["python", "native"]
    #: python: ``module:function`` (the kernel); native: the library's path in the bundle.
    entry: str
    #: native only: the ABI the library was built for, e.g. ``linux-x86_64/ort-api-17``.
    abi: str | None = None
    #: openvino extensions only (schema 1.1): the model formats whose OpenVINO front end the
    #: library has conversion rules for (``ov::frontend::onnx::OpExtension`` → ``onnx``).
    frontends: list[Frontend] = Field(default_factory=list)

    @model_validator(mode="after")
    def _entry_fits_kind(self) -> Self:
        if self.kind == "python" and not re.match(ENTRY_PATTERN, self.entry):
            raise ValueError(f"a python implementation's entry is module:function, got "
                             f"{self.entry!r}")
        if self.kind == "native" and not self.abi:
            raise ValueError("a native implementation must declare its abi "
                             "(e.g. linux-x86_64/ort-api-17)")
        names_frontends = (self.backend in technologies.registered()
                           and technologies.get(self.backend).plugin_frontends)
        if names_frontends and self.kind == "native" and not self.frontends:
            raise ValueError(
                f"the {self.backend} extension {self.entry!r} must name the front ends it "
                f"converts its ops for (frontends: [\"onnx\"] for "
                f"ov::frontend::onnx::OpExtension)")
        if self.frontends and not names_frontends:
            raise ValueError(f"frontends names OpenVINO front ends; implementation "
                             f"{self.entry!r} is for backend {self.backend!r}")
        return self


class PluginFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    #: Relative POSIX path inside the bundle; never absolute, never '..'.
    path: str
    sha256: str = Field(pattern=SHA256_PATTERN)
    size: int = Field(ge=0)


class PluginManifest(BaseModel):
    """``plugin.json`` at the root of a bundle."""

    model_config = ConfigDict(extra="forbid")

    #: ``"MAJOR.MINOR"``; the integer ``1`` of the first bundles reads as ``"1.0"``.
    schema_version: str = "1.0"
    name: str = Field(pattern=PLUGIN_NAME_PATTERN)
    version: str = Field(pattern=VERSION_PATTERN)
    description: str = ""
    ops: list[OpSpec] = Field(min_length=1)
    implementations: list[Implementation] = Field(min_length=1)
    files: list[PluginFile] = Field(default_factory=list)
    #: Python requirements of the implementations (e.g. ``onnxruntime-extensions>=0.12``).
    requires: list[str] = Field(default_factory=list)

    @field_validator("schema_version", mode="before")
    @classmethod
    def _version(cls, value: object) -> str:
        return version_field(value, what="a plugin manifest")

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        declared = {op.qualified_name for op in self.ops}
        if len(declared) != len(self.ops):
            raise ValueError("an op is declared twice")
        for impl in self.implementations:
            unknown = sorted(set(impl.ops) - declared)
            if unknown:
                raise ValueError(f"implementation {impl.entry!r} names ops the plugin does not "
                                 f"declare: {unknown}; declared: {sorted(declared)}")
        if (any(impl.frontends for impl in self.implementations)
                and parse_version(self.schema_version, what="a plugin manifest") < (1, 1)):
            # A 1.1 field: the document says so, so that a reader knows what it holds.
            self.schema_version = "1.1"
        return self

    def implementations_for(self, op: str) -> list[Implementation]:
        return [impl for impl in self.implementations if op in impl.ops]


def parse_plugin_manifest(data: dict[str, Any]) -> PluginManifest:
    """A decoded ``plugin.json``, honouring its ``schema_version`` (``SchemaUnsupported`` for a
    newer major; fields a newer minor added are ignored)."""
    return validate_versioned(PluginManifest, data, current=PLUGIN_SCHEMA_VERSION,
                              what="plugin manifest")


class PluginRef(BaseModel):
    """How an artifact names a plugin it needs."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    version: str
    #: sha256 of the bundle archive.
    digest: str = Field(pattern=SHA256_PATTERN)


class PluginInfo(BaseModel):
    """A plugin as the API lists it."""

    model_config = ConfigDict(extra="forbid")

    name: str
    version: str
    digest: str
    size_bytes: int
    ops: list[str]
    manifest: PluginManifest
    created_at: datetime
