#!/usr/bin/env bash
# Sets Shoal up (see setup.sh) and runs `shoal serve`: a private
# nats-server -js, a gateway on :8080 and a worker serving the demo models.
# Extra arguments go to `shoal serve` (try --help).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh shoal  # the server alone; test.sh builds the rest
exec "${SHOAL_BUILD_DIR:-build}/src/cli/shoal" serve "$@"
