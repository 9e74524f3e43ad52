#!/usr/bin/env bash
# mypy (strict on every package but the conformance suite) over the package as it is
# installed: a staged tree of symlinks (scripts/stage-package.sh says why).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
mypy=${MYPY:-"$root/.venv/bin/mypy"}
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
# shellcheck source=scripts/stage-package.sh
. "$root/scripts/stage-package.sh"
stage_package "$root" "$stage"
cd "$stage"
"$mypy" --config-file "$root/pyproject.toml" --cache-dir "$root/.mypy_cache" -p kvcached
