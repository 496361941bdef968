#!/usr/bin/env bash
# Run a command with the services the full test suite uses (a local SLURM cluster, headless Chromium):
# each .ci/setup.d/NAME.sh defines ci_up_NAME (install if missing, start) and ci_down_NAME (stop).
# Installing needs root and Debian's apt; without them the services are skipped, and so are the tests
# that need them (except under CI=true, where those tests fail instead).
# GPTLAB_CI_SERVICES="slurm mlflow_server" starts only those (default: every hook).
set -euo pipefail
cd "$(dirname "$0")/.."

hooks=()
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    for f in .ci/setup.d/*.sh; do
        [ -e "$f" ] || continue
        if [ -n "${GPTLAB_CI_SERVICES:-}" ] && [[ " $GPTLAB_CI_SERVICES " != *" $(basename "$f" .sh) "* ]]; then
            continue
        fi
        # shellcheck disable=SC1090
        source "$f"
        hooks+=("$(basename "$f" .sh)")
    done
else
    echo "with_services: not root with apt-get: no local SLURM or Chromium; their tests will be skipped" >&2
fi
cleanup() { for h in "${hooks[@]}"; do "ci_down_$h" || true; done; }
trap cleanup EXIT
for h in "${hooks[@]}"; do "ci_up_$h"; done

"$@"
