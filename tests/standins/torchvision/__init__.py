"""A torchvision stand-in for import chains on the CPU machine (see ../README.md): every
name is a class that raises when used; the checks that put it on the path import
modules that name torchvision but never call it."""

__version__ = "0.26.0"


class Missing:
    def __init__(self, *args: object, **kwargs: object) -> None:
        raise NotImplementedError("torchvision is a stand-in here (tests/standins/README.md)")


def missing(name: str) -> type:
    if name.startswith("__"):
        raise AttributeError(name)
    return Missing


__getattr__ = missing
