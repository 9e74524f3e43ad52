"""What the shim-table tests share: the adapter's code scanned for what it reaches of its
engine, and a table compared with the facts recorded from an engine's wheel.

A table that claims to be an adapter's whole contact surface must stay so as the code
changes. Two scans find what the code reaches without the table's knowledge:

* `engine_imports`: every ``from <engine>... import name`` in the adapter (the names
  it imports from its engine, lazily, inside functions);
* `private_names`: every private name (``_x``, not dunder) the adapter reaches on an
  object, as ``obj._x`` or ``getattr(obj, "_x", ...)``, that the adapter's own code
  does not define (its own classes' attributes and methods are not the engine's).

Each found name must be the last part of a target of the table.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _trees(folder: Path) -> list[tuple[str, ast.Module]]:
    return [(p.name, ast.parse(p.read_text())) for p in sorted(folder.glob("*.py"))]


def engine_imports(folder: Path, engine: str) -> set[str]:
    """``module.name`` for every name the adapter in `folder` imports from `engine`."""
    found: set[str] = set()
    for _name, tree in _trees(folder):
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == engine:
                found |= {f"{node.module}.{alias.name}" for alias in node.names}
            elif isinstance(node, ast.Import):  # `import vllm`: its version (a contact)
                found |= {a.name for a in node.names if a.name.split(".")[0] == engine}
    return found


def _own_names(trees: list[tuple[str, ast.Module]]) -> set[str]:
    """Names the adapter defines: functions, classes, class attributes, attributes it
    assigns on ``self``, module globals."""
    own: set[str] = set()
    for _name, tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                if isinstance(node.value, ast.Name) and node.value.id == "self":
                    own.add(node.attr)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                own |= {t.id for t in targets if isinstance(t, ast.Name)}
    return own


def private_names(folder: Path) -> dict[str, str]:
    """{private name: the file that reaches it} for the engine's private names."""
    trees = _trees(folder)
    own = _own_names(trees)
    found: dict[str, str] = {}
    for file, tree in trees:
        for node in ast.walk(tree):
            name = None
            if isinstance(node, ast.Attribute):
                name = node.attr
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "setattr", "hasattr")
                and len(node.args) > 1
                and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str)
            ):
                name = node.args[1].value
            if name and name.startswith("_") and not name.startswith("__") and name not in own:
                found.setdefault(name, file)
    return found


def last_parts(targets: set[str]) -> set[str]:
    return {target.replace(":", ".").rsplit(".", 1)[-1] for target in targets}


def unlisted(folder: Path, engine: str, targets: set[str]) -> list[str]:
    """What the adapter in `folder` reaches of `engine` that no target of its table names."""
    dotted = {target.replace(":", ".") for target in targets}
    lost = sorted(
        f"import {name}"
        for name in engine_imports(folder, engine)
        if not any(t == name or t.startswith(f"{name}.") for t in dotted)
    )
    names = last_parts(targets)
    private = private_names(folder)
    lost += sorted(f"{name} ({file})" for name, file in private.items() if name not in names)
    return lost


def facts(engine: str, version: str) -> dict[str, Any]:
    path = ROOT / "tests" / "engine_facts" / f"{engine}-{version}.json"
    loaded: dict[str, Any] = json.loads(path.read_text())
    return loaded


def disagreements(entries: list[Any], recorded: dict[str, Any]) -> list[str]:
    """How a table's entries for the recorded version differ from the recorded facts."""
    version = recorded["version"]
    table = {e.target: e for e in entries if version in e.versions}
    known: dict[str, str | None] = recorded["targets"]
    out = [f"not recorded: {t}" for t in sorted(set(table) - set(known))]
    out += [f"recorded but not in the table: {t}" for t in sorted(set(known) - set(table))]
    out += [
        f"absent from {recorded['engine']} {version}: {t}"
        for t, where in known.items()
        if where is None and t in table and not getattr(table[t], "optional", False)
    ]
    return out
