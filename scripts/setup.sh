#!/usr/bin/env bash
# Installs the Debian packages the project builds with. Idempotent; needs root
# (or sudo). Used by .ci/run and by the README's commands.
set -euo pipefail
PKGS=(build-essential cmake ninja-build pkg-config git python3 python3-pip
      libeigen3-dev nlohmann-json3-dev libcli11-dev libfmt-dev
      libgtest-dev libgmock-dev libbenchmark-dev libopenblas-dev libpcre2-dev libcpp-httplib-dev curl)
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
