#!/usr/bin/env bash
# System packages the tests use, installed when missing (needs root; otherwise the browser tests
# skip with a reason, or fail under AUTOTUNER_REQUIRE_BROWSER=1).
set -euo pipefail
if [ ! -x /usr/lib/chromium/chromium ]; then
  if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null; then
    echo "test deps: installing Debian's chromium for the browser tests" >&2
    (apt-get install -y -qq chromium chromium-driver >/dev/null 2>&1 \
      || { apt-get update -qq && apt-get install -y -qq chromium chromium-driver >/dev/null; })
  else
    echo "test deps: chromium missing and not root; browser tests will skip" >&2
  fi
fi
