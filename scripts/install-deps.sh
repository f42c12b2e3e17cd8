#!/usr/bin/env bash
# Installs every system package Shoal needs to build, test and serve (Debian 12).
# Idempotent: only missing packages are installed; safe to run again.
set -euo pipefail

PACKAGES=(
  build-essential cmake ninja-build pkg-config git ca-certificates curl
  nats-server libnats-dev
  libmsgpack-cxx-dev
  libboost-dev
  libtorch-dev libopenblas0-openmp python3-torch python3-numpy python3-msgpack
  nlohmann-json3-dev
  libssl-dev
  libcli11-dev
  libgtest-dev libgmock-dev
  gdb
  wamerican
  libtesseract-dev libleptonica-dev tesseract-ocr-eng tesseract-ocr-vie
  python3-pil fonts-dejavu-core
  nodejs
)

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

# Debian's nodejs ships npm separately; other nodejs builds bundle it.
if ! command -v npm >/dev/null 2>&1; then missing+=(npm); fi

# libtorch needs the OpenMP OpenBLAS; the pthread variant oversubscribes cores.
conflicting=()
if dpkg-query -W -f='${Status}' libopenblas0-pthread 2>/dev/null | grep -q "install ok installed"; then
  conflicting+=(libopenblas0-pthread)
fi

# apt as root; through sudo otherwise (env: sudo would drop the variable).
APT=(env DEBIAN_FRONTEND=noninteractive apt-get)
if [ "$(id -u)" -ne 0 ]; then
  if [ ${#missing[@]} -gt 0 ] || [ ${#conflicting[@]} -gt 0 ]; then
    if ! command -v sudo >/dev/null 2>&1; then
      echo "install-deps: not root and no sudo; as root, run:" >&2
      [ ${#missing[@]} -eq 0 ] || echo "  apt-get update && apt-get install --no-install-recommends ${missing[*]}" >&2
      [ ${#conflicting[@]} -eq 0 ] || echo "  apt-get remove ${conflicting[*]}" >&2
      exit 1
    fi
  fi
  APT=(sudo "${APT[@]}")
fi

if [ ${#missing[@]} -gt 0 ]; then
  echo "install-deps: installing ${missing[*]}"
  "${APT[@]}" update -qq
  "${APT[@]}" install -y -qq --no-install-recommends "${missing[@]}"
fi
if [ ${#conflicting[@]} -gt 0 ]; then
  echo "install-deps: removing ${conflicting[*]} (slow with libtorch)"
  "${APT[@]}" remove -y -qq "${conflicting[@]}"
fi
echo "install-deps: system packages ready"
