#!/usr/bin/env bash
# Installs the Debian packages the project builds with, and a Python virtual
# environment at .venv with the openai client (tests/serve/test_http.py). Idempotent;
# the apt step needs root (or sudo). Used by .ci/run and by the README's commands.
set -euo pipefail
PKGS=(build-essential cmake ninja-build pkg-config git python3 python3-pip
      libeigen3-dev nlohmann-json3-dev libcli11-dev libfmt-dev
      libgtest-dev libgmock-dev libopenblas-dev libpcre2-dev libcpp-httplib-dev curl
      python3-venv)
missing=()
for p in "${PKGS[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if ((${#missing[@]})); then
  SUDO=""; [[ $(id -u) -ne 0 ]] && SUDO=sudo
  echo "setup: installing ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# .venv: the openai client for the HTTP server tests, kept out of the system Python.
cd "$(dirname "$0")/.."
OPENAI_VERSION=3.57.0
venv_ok() {
  .venv/bin/python -c "import importlib.metadata as m, sys; sys.exit(m.version('openai') != '$OPENAI_VERSION')" \
    >/dev/null 2>&1
}
if ! venv_ok; then
  echo "setup: creating .venv with openai==$OPENAI_VERSION"
  if ! .venv/bin/python -c "" >/dev/null 2>&1; then
    python3 -m venv --clear .venv
  fi
  if ! .venv/bin/python -m pip install -q "openai==$OPENAI_VERSION" || ! venv_ok; then
    echo "setup: warning: could not install openai==$OPENAI_VERSION into .venv;" \
         "the serve_http test will fail" >&2
  fi
fi
