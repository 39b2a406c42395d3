"""Fixtures for the plugin tests: the example bundles, and artifacts compiled with them."""

from tests.plugins.helpers import example_bundles, plugin_artifacts
from tests.runtime_agent.helpers import built

__all__ = ["built", "example_bundles", "plugin_artifacts"]
