"""The end-to-end tests share the flow tests' fixtures."""

from tests.flows.conftest import plugin_sandbox, tiny, tiny_gn  # noqa: F401 - fixtures, found by name
