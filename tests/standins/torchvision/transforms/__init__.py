"""A torchvision stand-in (tests/standins/README.md)."""

import enum

from torchvision import missing as __getattr__  # noqa: F401


class InterpolationMode(enum.Enum):  # read at import time by SGLang's configs
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"
