"""The conformance suite every kvcached backend must pass (see suite.py for how to run it)."""

from kvcached.conformance.suite import ConformanceSuite

__all__ = ["ConformanceSuite"]
