"""Fixtures for the runtime-agent tests (defined in ``helpers``, shared with ``tests/kiln``)."""

from tests.plugins.helpers import example_bundles, plugin_artifacts
from tests.runtime_agent.helpers import _control_plane_server, built, control_plane

__all__ = ["_control_plane_server", "built", "control_plane", "example_bundles",
           "plugin_artifacts"]
