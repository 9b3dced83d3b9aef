#!/usr/bin/env bash
# Debian packages features need, installed where this runs as root with apt-get; elsewhere one line
# each names the package (what needs it goes on without it, refusing in one line when used).
#   bubblewrap: the sandbox of the `python` tool and `opentinker sandbox` (opentinker/tools/sandbox.py)
#   iproute2: tests/hosts.py (a second host as a network namespace)
#   chromium: the console's browser tests (tests/test_console.py, tests/cdp.py) and its pictures
#             (docs/console_screenshots.py)
set -u
need() {  # need COMMAND PACKAGE WHAT
  command -v "$1" >/dev/null 2>&1 && return 0
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    if DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$2" >/dev/null 2>&1 \
       || { apt-get update -qq >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$2" >/dev/null 2>&1; }; then
      echo "installed the Debian package $2 ($3)"
      return 0
    fi
  fi
  echo "$3 needs the Debian package $2, not installed here: sudo apt-get install $2"
}
need bwrap bubblewrap "the sandboxed python tool (env.tools: [{python: ...}], envs.code_interpreter, opentinker sandbox)"
need ip iproute2 "the two-host tests (tests/hosts.py: a network namespace as a second machine)"
need chromium chromium "the console's browser tests (tests/test_console.py) and docs/console_screenshots.py"
exit 0
