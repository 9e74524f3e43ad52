"""A torchvision stand-in for the SGLang CPU checks (see the README two folders up)."""

from torchvision import missing as __getattr__  # noqa: F401
