"""The fingerprint keys an agent may claim: exactly those the technologies' rules derive
from the fingerprint it reports. A key names a build queue, so a key no rule derives would
queue builds no worker can take (or that one hardware class would take for another).

The rules are ``schemas.technologies``: pure functions of a fingerprint, written once for
workers, agents (whose executors inherit them) and this check.
"""

from __future__ import annotations

from schemas.agents import AgentRegistration
from schemas.errors import ErrorCode, InvalidRequest, KilnError
from schemas.fingerprint import (
    HardwareFingerprint,
    fingerprint_inconsistencies,
    tuning_context_key,
)
from schemas.technologies import (
    get,
    node_compatibility_keys,
    node_fingerprint_keys,
    peer_backends,
)


class FingerprintInconsistent(KilnError):
    """A declared fingerprint whose features contradict its architecture or ISA level: the
    request is well-formed but describes no machine (422)."""

    code = ErrorCode.FINGERPRINT_INCONSISTENT


def check_claimed_keys(registration: AgentRegistration) -> None:
    """``InvalidRequest`` (400) naming the first fingerprint or compatibility key of
    ``registration`` that the technologies' rules do not derive from its fingerprint."""
    fingerprint = registration.fingerprint
    problems = fingerprint_inconsistencies(fingerprint)
    if problems:
        raise FingerprintInconsistent(
            f"agent {registration.name!r} declares a fingerprint no {fingerprint.cpu.arch} CPU "
            f"has: {'; '.join(problems)}", problems=problems, arch=fingerprint.cpu.arch)
    try:
        derived = node_fingerprint_keys(fingerprint)
        compatible = node_compatibility_keys(fingerprint)
    except KilnError as exc:
        raise InvalidRequest(f"no fingerprint key can be derived from agent "
                             f"{registration.name!r}'s fingerprint: {exc.message}") from exc
    for backend, key in registration.fingerprint_keys.items():
        if derived.get(backend) != key:
            found = (f"derive {derived[backend]!r} for it" if backend in derived
                     else "have no key for it on this hardware")
            raise InvalidRequest(
                f"agent {registration.name!r} claims fingerprint key {key!r} for backend "
                f"{backend!r}, but the control plane's key rules {found}; the keys its "
                f"fingerprint derives are {derived}", key=key, backend=backend,
                derived=derived)
    for backend, keys in registration.compatibility_keys.items():
        extra = sorted(set(keys) - set(compatible.get(backend, [])))
        if extra:
            raise InvalidRequest(
                f"agent {registration.name!r} claims compatibility key(s) {extra} for backend "
                f"{backend!r}, which its fingerprint does not derive; it derives "
                f"{compatible.get(backend, [])}", keys=extra, backend=backend)


def backends_planned_only_when_named() -> set[str]:
    """Backends whose candidates race in another backend's job on the worker
    (``Technology.joins_as_peer``) or built only when named (``planned_unnamed``): a
    deployment that names no backend is not planned for them."""
    return peer_backends()


def node_context_keys(fingerprint: HardwareFingerprint,
                      fingerprint_keys: dict[str, str]) -> dict[str, str]:
    """Backend → the key of this node's own tuning for it (``tuning_context_key`` with the
    executor's ``tuning_features``): what a worker of the same context advertises, and
    where the planner looks for, and queues, the node's own engine."""
    return {backend: tuning_context_key(key, fingerprint, get(backend).tuning_features)
            for backend, key in fingerprint_keys.items()}
