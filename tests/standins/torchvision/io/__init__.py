"""A torchvision stand-in (tests/standins/README.md)."""

from torchvision import missing as __getattr__  # noqa: F401
