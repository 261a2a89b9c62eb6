#!/bin/sh
# Part of `make test`: the browser tests drive Debian's headless Chromium.
# Install it when it is missing and this machine can install packages (root,
# or passwordless sudo, and apt-get). Otherwise do nothing: pytest then skips
# the browser tests with one line that says how to install it.
# P2PFL_CHROMIUM names the browser binary to use; P2PFL_NO_BROWSER_INSTALL=1
# turns the installation off.
set -u
browser="${P2PFL_CHROMIUM:-chromium}"
if command -v "$browser" >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then
  exit 0
fi
if [ "${P2PFL_NO_BROWSER_INSTALL:-0}" = 1 ] || [ -n "${P2PFL_CHROMIUM:-}" ]; then
  exit 0
fi
command -v apt-get >/dev/null 2>&1 || exit 0
if [ "$(id -u)" = 0 ]; then
  sudo=""
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
  sudo="sudo -n"
else
  exit 0
fi
echo "make test: installing Debian's chromium for the browser tests (P2PFL_NO_BROWSER_INSTALL=1 skips this)"
$sudo apt-get update -qq >/dev/null 2>&1
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq chromium >/dev/null 2>&1 \
  || echo "make test: chromium could not be installed; the browser tests will be skipped"
exit 0
