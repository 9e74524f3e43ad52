#!/usr/bin/env bash
# The import contracts of pyproject.toml ([tool.importlinter]: the layers, the engines'
# independence, no circles) over the package as it is installed: a staged tree of
# symlinks (scripts/stage-package.sh says why), found first on PYTHONPATH. Arguments go
# to lint-imports (e.g. --contract layers).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
lint=${LINT_IMPORTS:-"$root/.venv/bin/lint-imports"}
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
# shellcheck source=scripts/stage-package.sh
. "$root/scripts/stage-package.sh"
stage_package "$root" "$stage"
cd "$stage"
PYTHONPATH="$stage" "$lint" --no-cache --no-logo "$@" "$root/pyproject.toml"
