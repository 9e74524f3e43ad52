"""Engine adapters, one folder each; each imports its engine lazily.

Every adapter is a plugin its engine loads in all of its processes; `enabled()` is the
one switch they share, cheap enough to call before anything else is imported.
"""

from __future__ import annotations

from kvcached.config import engines_enabled


def enabled() -> bool:
    """ENABLE_KVCACHED is set (1, true, yes or on): the engine plugins act
    (`kvcached.config.engines_enabled`, where every variable is read)."""
    return engines_enabled()
