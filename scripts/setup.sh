#!/usr/bin/env bash
# Sets Shoal up on a Debian 12 machine: system packages, the demo model
# repository (generated with Debian's python3-torch), the OCR test images
# (rendered with Debian's Pillow and DejaVu font) and a Release build in
# ./build. Idempotent: a second run only rebuilds what changed.
# Arguments name the CMake targets to build (default: all, tests included);
# serve.sh builds only `shoal`.
set -euo pipefail
cd "$(dirname "$0")/.."

BUILD_DIR="${SHOAL_BUILD_DIR:-build}"
JOBS="${SHOAL_JOBS:-$(nproc)}"

# serve.sh and test.sh started together would write the same generated
# files and build in the same directory at once: the second one waits.
mkdir -p .shoal
exec 9> .shoal/setup.lock
if ! flock -n 9; then
  echo "setup: waiting for another setup of this checkout to finish"
  flock 9
fi

bash scripts/install-deps.sh

echo "setup: generating the demo model repository in models/"
# Debian's interpreter has python3-torch; a python3 earlier on PATH may not.
/usr/bin/python3 scripts/make_models.py --out models

echo "setup: rendering the OCR test images in testdata/ocr/"
/usr/bin/python3 scripts/make_ocr_images.py --out testdata/ocr

echo "setup: building in ${BUILD_DIR}/"
cmake -S . -B "${BUILD_DIR}" -G Ninja -DCMAKE_BUILD_TYPE="${SHOAL_BUILD_TYPE:-Release}" \
  -DSHOAL_BUILD_TESTS=ON -DSHOAL_BUILD_BENCH=ON > /dev/null
cmake --build "${BUILD_DIR}" -j "${JOBS}" ${1:+--target "$@"}
echo "setup: done; the binary is ${BUILD_DIR}/src/cli/shoal"
