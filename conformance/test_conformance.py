"""Collected by `pytest --pyargs kvcached.conformance`: the suite against the selected backend."""

from kvcached.conformance.suite import ConformanceSuite


class TestBackendConformance(ConformanceSuite):
    """Runs every check of the suite; fixtures come from kvcached.conformance.plugin."""
