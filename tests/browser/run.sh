#!/usr/bin/env bash
# One command: start JupyterLab on loopback, run Lab 1 in headless Chromium, save a screenshot.
#   bash tests/browser/run.sh [OUT_DIR]
# Needs: Chromium (Debian: apt-get install chromium) and Node.js; installs playwright-core locally.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
out="${1:-$repo/runs/browser}"
mkdir -p "$out"
command -v "${CHROMIUM:-/usr/bin/chromium}" >/dev/null || { echo "Chromium not found: apt-get install chromium (or set CHROMIUM)"; exit 2; }
command -v jupyter >/dev/null || { echo "jupyter not found: activate the environment labkit is installed in (source .venv/bin/activate)"; exit 2; }
(cd "$here" && [ -d node_modules/playwright-core ] || npm install --silent --no-audit --no-fund)

# Run a copy: JupyterLab autosaves, and committed notebooks must stay without outputs.
work="$(mktemp -d)"
cp "$repo/notebooks/01_input_pipeline.ipynb" "$work/"
# Render every cell (JupyterLab 4 virtualises long notebooks by default), in a private settings dir.
export JUPYTERLAB_SETTINGS_DIR="$work/settings"
mkdir -p "$JUPYTERLAB_SETTINGS_DIR/@jupyterlab/notebook-extension"
echo '{"windowingMode": "none"}' >"$JUPYTERLAB_SETTINGS_DIR/@jupyterlab/notebook-extension/tracker.jupyterlab-settings"
port="$(python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
token="labkit-smoke-$RANDOM"
jupyter lab --no-browser --allow-root --ip 127.0.0.1 --port "$port" --IdentityProvider.token="$token" \
  --ServerApp.root_dir="$work" >"$out/jupyterlab.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null || true' EXIT
ready=0
for _ in $(seq 60); do curl -fs "http://127.0.0.1:$port/api?token=$token" >/dev/null && { ready=1; break; }; sleep 1; done
[ "$ready" = 1 ] || { echo "JupyterLab did not answer within 60 s; its log ($out/jupyterlab.log) ends:"; tail -20 "$out/jupyterlab.log"; exit 1; }
node "$here/smoke.mjs" "http://127.0.0.1:$port/lab/tree/01_input_pipeline.ipynb?token=$token" \
  "$out/lab01.png" "${SMOKE_TIMEOUT_S:-600}"
