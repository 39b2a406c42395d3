"""Kiln: ahead-of-time compile farm and artifact store for ML models.

``import kiln`` is cheap: the client and its result types load on first use::

    import kiln
    job = kiln.Client(url, token).submit("model.onnx", precision="auto")
    artifact = job.wait()          # a kiln.ArtifactManifest
"""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

#: Public name → the module that defines it (imported when the name is first read).
_EXPORTS = {
    "Client": "kiln.client",
    "KilnClient": "kiln.client",
    "Job": "kiln.client",
    "DeploymentHandle": "kiln.client",
    "DeploymentApplied": "kiln.client",
    "AgentServing": "kiln.client",
    "ArtifactManifest": "schemas.manifest",
    "ArtifactSummary": "schemas.manifest",
    "CompileJob": "schemas.jobs",
    "JobStatus": "schemas.jobs",
    "CompileOptions": "schemas.options",
    "Precision": "schemas.options",
    "ModelInfo": "schemas.models",
    "Deployment": "schemas.deployments",
    "KilnError": "schemas.errors",
}

__all__ = [  # noqa: RUF022 - grouped as _EXPORTS is
    "__version__", "Client", "KilnClient", "Job", "DeploymentHandle", "DeploymentApplied",
    "AgentServing", "ArtifactManifest", "ArtifactSummary", "CompileJob", "JobStatus",
    "CompileOptions", "Precision", "ModelInfo", "Deployment", "KilnError",
]

if TYPE_CHECKING:
    from kiln.client import (
        AgentServing,
        Client,
        DeploymentApplied,
        DeploymentHandle,
        Job,
        KilnClient,
    )
    from schemas.deployments import Deployment
    from schemas.errors import KilnError
    from schemas.jobs import CompileJob, JobStatus
    from schemas.manifest import ArtifactManifest, ArtifactSummary
    from schemas.models import ModelInfo
    from schemas.options import CompileOptions, Precision


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kiln' has no attribute {name!r}")
    value = getattr(_load(module), name)
    globals()[name] = value
    return value


def _load(module: str) -> ModuleType:
    """The module of ``_EXPORTS`` named ``module``, imported statically (an import by a name
    string would import whatever it was handed)."""
    if module == "kiln.client":
        from kiln import client as loaded
    elif module == "schemas.manifest":
        from schemas import manifest as loaded
    elif module == "schemas.jobs":
        from schemas import jobs as loaded
    elif module == "schemas.options":
        from schemas import options as loaded
    elif module == "schemas.models":
        from schemas import models as loaded
    elif module == "schemas.deployments":
        from schemas import deployments as loaded
    elif module == "schemas.errors":
        from schemas import errors as loaded
    else:
        raise AttributeError(f"module 'kiln' exports nothing from {module!r}")
    return loaded


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
