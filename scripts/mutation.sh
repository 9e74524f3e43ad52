#!/usr/bin/env bash
# Mutation testing of the core: mutmut 3 makes small changes (mutants) to the ledger
# (kvcached/ledger/: its budget, file and liveness modules) and to
# kvcached/{allocator,page_book,replay,charged,config}.py, runs the unit tests of those
# modules against each, and a mutant that no test fails is a gap in the tests.
#
#   scripts/mutation.sh                     every mutant of those modules (hours here)
#   scripts/mutation.sh charged replay      the mutants of these modules only
#   scripts/mutation.sh ledger              every module of the ledger package
#   scripts/mutation.sh 'kvcached.ledger.book.xǁLedgerǁ_reclaim_dead*'   any mutmut name glob
#
# What is mutated and which tests run is [tool.mutmut] in pyproject.toml (MUTATION_CONFIG
# names another file with that section, to try a different selection). mutmut is
# installed into the venv if it is missing. It runs in a scratch copy of kvcached/, tests/
# and pyproject.toml (MUTATION_DIR, default build/mutation, made afresh each run), so the
# working tree gets no mutants/ folder and edits made during a run do not leak into it;
# kvcached.backends, .engines and .conformance still come from the working tree, through
# the editable install. Afterwards it prints the score and every surviving mutant; see
# one with: cd build/mutation && ../../.venv/bin/mutmut show NAME
#
# MUTATION_JOBS: mutants run at once (default: one per core). MUTATION_TIMEOUT: stop the
# run after this long (a `timeout` duration, e.g. 20m) and report what it reached.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
venv=${VENV:-"$root/.venv"}
work=${MUTATION_DIR:-"$root/build/mutation"}
config=${MUTATION_CONFIG:-"$root/pyproject.toml"}
py="$venv/bin/python"

if ! grep -q '^\[tool\.mutmut\]' "$config"; then
    echo "$config has no [tool.mutmut] section (what to mutate, which tests run)" >&2
    exit 2
fi
if ! "$py" -c 'import importlib.metadata as m, sys
sys.exit(int(m.version("mutmut").split(".")[0]) < 3)' 2>/dev/null; then
    "$py" -m pip install -q "mutmut>=3.8,<4"
fi

rm -rf "$work"
mkdir -p "$work"
(cd "$root" && tar --exclude=__pycache__ -cf - kvcached tests pyproject.toml) | tar -xf - -C "$work"
if [ "$config" != "$root/pyproject.toml" ]; then  # its section replaces pyproject's
    section='/^\[tool\.mutmut\]/,/^\[/'
    sed -i "$section"'{/^\[tool\.mutmut\]/d;/^\[/!d}' "$work/pyproject.toml"
    { echo; sed -n "$section"'{/^\[tool\.mutmut\]/p;/^\[/!p}' "$config"; } >>"$work/pyproject.toml"
fi

patterns=()
for arg in "$@"; do
    case $arg in
        *.*) patterns+=("$arg") ;;
        *) patterns+=("kvcached.$arg.*") ;;
    esac
done

cd "$work"
started=$(date +%s)
status=0
# Ctrl-C is how mutmut is stopped cleanly (it then stops its workers and keeps results)
timeout -s INT -k 60 "${MUTATION_TIMEOUT:-0}" \
    "$venv/bin/mutmut" run --max-children "${MUTATION_JOBS:-$(nproc)}" "${patterns[@]}" \
    >mutmut.log 2>&1 || status=$?
echo "mutmut run: exit $status after $(($(date +%s) - started)) s (its output: $work/mutmut.log)"

"$venv/bin/mutmut" results --all true | "$py" -c '
import collections, fnmatch, sys

patterns = sys.argv[1:] or ["*"]
status = {}
for line in sys.stdin:
    name, sep, verdict = line.strip().rpartition(": ")
    if sep and any(fnmatch.fnmatch(name, p) for p in patterns):
        status[name] = verdict
counts = collections.Counter(status.values())
detected = counts["killed"] + counts["timeout"] + counts["caught by type check"]
missed = counts["survived"] + counts["no tests"] + counts["suspicious"]
print(", ".join(f"{n} {verdict}" for verdict, n in sorted(counts.items())))
if detected + missed:
    print(f"score: {detected}/{detected + missed} = {100 * detected / (detected + missed):.1f}% "
          "(killed or timed out, of every mutant checked)")
for name, verdict in sorted(status.items()):
    if verdict in ("survived", "no tests", "suspicious"):
        print(f"  {verdict}: {name}")
' "${patterns[@]}"
exit "$status"
