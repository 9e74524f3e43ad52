#!/usr/bin/env bash
# Debian's Chromium for the dashboard's browser test (tests/test_serve_dashboard.py:
# Python playwright, its bundled driver, launching /usr/bin/chromium). Never
# `playwright install`: it downloads a browser build of its own, which closed networks
# such as CI's refuse. `make test` runs this before pytest, and the test's fixture runs
# it when the browser is missing and it is root with apt-get, so the browser test runs
# in CI instead of being skipped.
#
#   KVCACHED_CHROMIUM=PATH         the browser to use (default /usr/bin/chromium)
#   KVCACHED_SKIP_BROWSER_TESTS=1  for a developer who cannot install it (no root, not
#                                  Debian): this script and the browser tests then skip,
#                                  saying so. CI never sets it.
#
# As root with apt-get it installs `chromium` (and fonts-liberation, so that the page's
# text renders in screenshots) without the recommended packages (a printing system,
# udev, a notification daemon: none of it serves a headless browser). Otherwise, or if
# the install fails, it says what to do and exits 1.
set -euo pipefail
chromium=${KVCACHED_CHROMIUM:-/usr/bin/chromium}
if [ -x "$chromium" ]; then
    exit 0
fi
if [ -n "${KVCACHED_SKIP_BROWSER_TESTS:-}" ]; then
    echo "ensure-chromium: $chromium is missing; KVCACHED_SKIP_BROWSER_TESTS is set," \
        "so the browser tests will be skipped" >&2
    exit 0
fi
if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "ensure-chromium: installing Debian's chromium (apt-get)" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -q --no-install-recommends chromium fonts-liberation >/dev/null
    if [ -x "$chromium" ]; then
        exit 0
    fi
fi
cat >&2 <<MESSAGE
ensure-chromium: no browser at $chromium, and it could not be installed here (that needs
root and apt-get). The dashboard's browser test needs Debian's chromium:
    sudo apt-get install chromium      (Debian, Ubuntu: the package chromium)
or point KVCACHED_CHROMIUM at a Chromium or Chrome binary, or skip the browser tests:
    KVCACHED_SKIP_BROWSER_TESTS=1 make test
MESSAGE
exit 1
