"""A torchvision stand-in for the SGLang CPU checks (see ../README.md): every name is a
class that raises when used; the programs import SGLang modules that name torchvision
but never call it."""

__version__ = "0.26.0"


class Missing:
    def __init__(self, *args: object, **kwargs: object) -> None:
        raise NotImplementedError("torchvision is a stand-in in the SGLang CPU checks")


def missing(name: str) -> type:
    if name.startswith("__"):
        raise AttributeError(name)
    return Missing


__getattr__ = missing
