"""Fixtures for the SDK and CLI tests: the runtime-agent tests' signed artifacts, and the
artifacts compiled with the example plugins."""

from tests.plugins.helpers import example_bundles, plugin_artifacts
from tests.runtime_agent.helpers import built

__all__ = ["built", "example_bundles", "plugin_artifacts"]
