#!/usr/bin/env bash
# Sets Shoal up (see setup.sh) and runs the whole test suite: unit,
# integration (real nats-server), end-to-end (built binaries over HTTP) and
# the official OpenAI SDK against `shoal serve`, and object-store interop with
# the official nats Node.js client.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
BUILD_DIR="$(cd "${SHOAL_BUILD_DIR:-build}" && pwd)"  # absolute, given either way
TEST_JOBS="${SHOAL_TEST_JOBS:-2}"

# The tests start their own servers and workers: a deployment's SHOAL_*
# settings in this shell (SHOAL_DEVICE, SHOAL_MODELS_DIR, ...) must not
# reach them.
for v in $(compgen -e); do
  case "$v" in SHOAL_*) unset "$v" ;; esac
done
# Debian installs nats-server in /usr/sbin, which a user's PATH may lack
# (the Node.js test starts it by name).
export PATH="${PATH}:/usr/local/sbin:/usr/sbin:/sbin"

echo "test: C++ unit, integration and end-to-end tests"
ctest --test-dir "${BUILD_DIR}" --output-on-failure --no-tests=error -j "${TEST_JOBS}" --timeout 300

node_major="$(node -p 'process.versions.node.split(".")[0]')"
if [ "${node_major}" -lt 20 ]; then
  echo "test: warning: Node.js $(node --version) is older than the 20 the OpenAI SDK asks for"
fi
echo "test: official OpenAI SDK (Node.js) against shoal serve"
npm ci --prefix tests/js --no-audit --no-fund --loglevel=error
SHOAL_BIN="${BUILD_DIR}/src/cli/shoal" SHOAL_MODELS_DIR="$(pwd)/models" \
  node --test tests/js/openai_sdk_test.mjs tests/js/openai_chat_test.mjs
echo "test: NATS object store interop with the nats Node.js client"
SHOAL_BLOB_TOOL="${BUILD_DIR}/tests/shoal_blob_tool" \
  node --test tests/js/objstore_interop_test.mjs
echo "test: all passed"
