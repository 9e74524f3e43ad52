#!/usr/bin/env bash
# mypy (strict on kvcached/ and backends/) over the package as it is installed.
# mypy cannot follow setuptools' package-dir mapping (backends/ -> kvcached.backends),
# so it checks a staged tree of symlinks laid out like the installed package.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
mypy=${MYPY:-"$root/.venv/bin/mypy"}
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/kvcached"
for entry in "$root"/kvcached/*; do
    case "$(basename "$entry")" in __pycache__) continue ;; esac
    ln -s "$entry" "$stage/kvcached/"
done
ln -s "$root/backends" "$stage/kvcached/backends"
ln -s "$root/engines" "$stage/kvcached/engines"
ln -s "$root/conformance" "$stage/kvcached/conformance"
cd "$stage"
"$mypy" --config-file "$root/pyproject.toml" --cache-dir "$root/.mypy_cache" -p kvcached
