"""The typed errors of the custom-op machinery (subclasses of ``schemas.errors``).

Each says which op, which plugin and what is available, and carries the error code (and HTTP
status) of its base class: ``unknown_operator`` for an op nobody registered,
``plugin_error`` for a plugin that cannot be used here, ``conflict`` for a second
registration.
"""

from __future__ import annotations

from schemas.errors import Conflict, PluginError, UnknownOperator


class UnknownOp(UnknownOperator):
    """An op nobody registered; the message lists the registered ops."""


class DuplicateOp(Conflict):
    """An op (or a kernel for one backend and device) registered twice."""


class NoImplementation(PluginError):
    """An op has no implementation for the backend and device asked for; the message lists
    the (backend, device) pairs it has."""


class AbiMismatch(PluginError):
    """A native library built for another platform or runtime ABI than this one."""


class ShapeFunctionError(PluginError):
    """An op's shape function raised, or returned something that is not its outputs' types."""
