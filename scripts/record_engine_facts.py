"""Record where each shim-table target of one engine version is defined, from its wheel.

vLLM 0.26 and SGLang 0.5.16 run only on the GPU machine, so the tests cannot import
them to check the adapters' tables (engines/vllm/shims.py, engines/sglang/shims.py).
This script reads the engine's own source instead: it unpacks the ``.py`` files of the
wheel, finds every target of the tables written for `--version` by parsing those files
(a module's top-level names, following ``from x import y``; a class's methods, class
attributes, fields and the attributes its methods assign or read on ``self``, through
its bases), and writes tests/engine_facts/<engine>-<version>.json: for each target the
file and line that define it, or null for an optional target the version lacks. It
refuses to write when a target that is not optional is not found, naming it.
tests/test_vllm_shims.py and tests/test_sglang_adapter.py then check that the tables
and the recorded facts agree, and the start-up check (`install()`) repeats the same
lookup against the installed engine on the device.

    python scripts/record_engine_facts.py --engine vllm --version 0.26 \\
        --wheel vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl
    python scripts/record_engine_facts.py --engine sglang --version 0.5.16 \\
        --wheel sglang-0.5.16-cp311-cp311-manylinux_2_34_x86_64.whl

(`pip download vllm==0.26.0 --no-deps` fetches the wheel.)
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import tempfile
import zipfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
FACTS = ROOT / "tests" / "engine_facts"


class Source:
    """An engine's unpacked Python source, looked up by module and name (no imports)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._trees: dict[str, ast.Module | None] = {}

    def file(self, module: str) -> Path | None:
        base = self.root / module.replace(".", "/")
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate
        return None

    def tree(self, module: str) -> ast.Module | None:
        if module not in self._trees:
            path = self.file(module)
            self._trees[module] = None if path is None else ast.parse(path.read_text())
        return self._trees[module]

    def where(self, module: str, line: int) -> str:
        path = self.file(module)
        assert path is not None
        return f"{path.relative_to(self.root)}:{line}"

    def name(self, module: str, name: str, depth: int = 0) -> tuple[str, Any] | None:
        """(where, the defining node or None) of the top-level `name` of `module`."""
        tree = self.tree(module)
        if tree is None or depth > 8:
            return None
        for stmt in _top_level(tree.body):
            if isinstance(stmt, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                if stmt.name == name:
                    return self.where(module, stmt.lineno), (module, stmt)
            elif isinstance(stmt, (ast.Assign, ast.AnnAssign)):
                targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                    return self.where(module, stmt.lineno), None
            elif isinstance(stmt, ast.Import):
                for alias in stmt.names:
                    if (alias.asname or alias.name.split(".")[0]) == name:
                        return self.where(module, stmt.lineno), None
            elif isinstance(stmt, ast.ImportFrom):
                for alias in stmt.names:
                    if alias.name == "*":  # re-exported: look in the source module
                        source = _absolute(module, stmt, self.file(module))
                        found = self.name(source, name, depth + 1)
                        if found is not None:
                            return found
                        continue
                    if (alias.asname or alias.name) != name:
                        continue
                    source = _absolute(module, stmt, self.file(module))
                    found = self.name(source, alias.name, depth + 1)
                    if found is not None:
                        return found
                    if self.file(f"{source}.{alias.name}") is not None:
                        return self.where(module, stmt.lineno), None  # a submodule
                    return self.where(module, stmt.lineno), None
        if self.file(f"{module}.{name}") is not None:  # a submodule of a package
            return f"{self.file(f'{module}.{name}')}", None
        return None

    def attribute(self, module: str, cls: ast.ClassDef, name: str, depth: int = 0) -> str | None:
        """Where class `cls` (of `module`), or a base, defines or uses `name`."""
        if depth > 8:
            return None
        for stmt in cls.body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.name == name:
                return self.where(module, stmt.lineno)
            if isinstance(stmt, (ast.Assign, ast.AnnAssign)):
                targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                    return self.where(module, stmt.lineno)
        used = None
        for node in ast.walk(cls):
            if isinstance(node, ast.Attribute) and node.attr == name:
                owner = node.value
                if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                    if isinstance(node.ctx, ast.Store):
                        return self.where(module, node.lineno)
                    used = used or self.where(module, node.lineno)
        if used is not None:
            return used
        for base in cls.bases:
            if isinstance(base, ast.Name):
                found = self.name(module, base.id)
                if found is not None and found[1] is not None:
                    base_module, node = found[1]
                    if isinstance(node, ast.ClassDef):
                        where = self.attribute(base_module, node, name, depth + 1)
                        if where is not None:
                            return where
        return None

    def find(self, target: str) -> str | None:
        """Where `target` (``module:A.b`` or dotted) is defined, or None."""
        if ":" in target:
            module, _, rest = target.partition(":")
            path = rest.split(".")
        else:
            parts = target.split(".")
            cut = max(i for i in range(1, len(parts) + 1) if self.file(".".join(parts[:i])))
            module, path = ".".join(parts[:cut]), parts[cut:]
        found = self.name(module, path[0])
        if found is None:
            return None
        where, defined = found
        for name in path[1:]:
            if defined is None or not isinstance(defined[1], ast.ClassDef):
                return None
            where_attr = self.attribute(defined[0], defined[1], name)
            if where_attr is None:
                return None
            where, defined = where_attr, None
        return where


def _top_level(body: list[ast.stmt]) -> list[ast.stmt]:
    """A module's statements, with those inside top-level if/try blocks."""
    out: list[ast.stmt] = []
    for stmt in body:
        if isinstance(stmt, ast.If):
            out += _top_level(stmt.body) + _top_level(stmt.orelse)
        elif isinstance(stmt, ast.Try):
            out += _top_level(stmt.body)
            for handler in stmt.handlers:
                out += _top_level(handler.body)
        else:
            out.append(stmt)
    return out


def _absolute(module: str, stmt: ast.ImportFrom, path: Path | None) -> str:
    if not stmt.level:
        return stmt.module or ""
    package = module.split(".")
    if path is None or path.name != "__init__.py":
        package = package[:-1]
    package = package[: len(package) - (stmt.level - 1)]
    return ".".join(package + ([stmt.module] if stmt.module else []))


def entries(engine: str) -> list[Any]:
    """Both tables of `engine`'s adapter (imports the adapter, not the engine)."""
    if engine == "vllm":
        from kvcached.engines.vllm import shims as vllm_shims

        return [*vllm_shims.SHIMS, *vllm_shims.CONTACTS]
    from kvcached.engines.sglang import shims as sglang_shims

    return [*sglang_shims.SHIMS, *sglang_shims.CONTACTS]


def record(engine: str, version: str, source: Source, wheel: Path) -> dict[str, Any]:
    targets: dict[str, str | None] = {}
    lost: list[str] = []
    for entry in entries(engine):
        if version not in entry.versions:
            continue
        where = source.find(entry.target)
        if where is None and not getattr(entry, "optional", False):
            lost.append(f"{entry.target} ({entry.concern})")
        targets[entry.target] = where
    if lost:
        raise SystemExit(f"{engine} {version} ({wheel.name}) has no " + "; no ".join(lost))
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    return {
        "engine": engine,
        "version": version,
        "wheel": wheel.name,
        "sha256": digest,
        "targets": dict(sorted(targets.items())),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engine", choices=("vllm", "sglang"), required=True)
    ap.add_argument("--version", required=True, help="as the table spells it: 0.26, 0.5.16")
    ap.add_argument("--wheel", type=Path, required=True)
    ap.add_argument("--out", type=Path, default=None, help="default: tests/engine_facts/")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        with zipfile.ZipFile(a.wheel) as wheel:
            wheel.extractall(scratch, [n for n in wheel.namelist() if n.endswith(".py")])
        facts = record(a.engine, a.version, Source(Path(scratch)), a.wheel)
    out = a.out or FACTS / f"{a.engine}-{a.version}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(facts, indent=1) + "\n")
    print(f"{out}: {len(facts['targets'])} targets of {a.engine} {a.version}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
