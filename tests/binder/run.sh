#!/usr/bin/env bash
# Build what Binder (repo2docker) builds from binder/, as far as one machine allows, and check it:
# a fresh venv, `pip install -r binder/requirements.txt` from the repo root, binder/postBuild,
# then binder/start running `labkit doctor`. Not part of CI (several minutes of installs and op builds).
#
#   bash tests/binder/run.sh [REPO]     # REPO defaults to this checkout; a clean clone is made from it
set -euo pipefail
repo=$(cd "${1:-$(dirname "$0")/../..}" && pwd)
work=$(mktemp -d /tmp/labkit-binder.XXXX)
git clone -q "$repo" "$work/repo"
cd "$work/repo"
python3 -m venv "$work/env"
# shellcheck disable=SC1091
source "$work/env/bin/activate"
export CONDA_DIR="$work/env"  # where repo2docker's postBuild and start find the environment
start=$(date +%s)
pip install -q -r binder/requirements.txt
echo "binder: requirements installed in $(( $(date +%s) - start )) s"
start=$(date +%s)
bash binder/postBuild
echo "binder: postBuild done in $(( $(date +%s) - start )) s"
bash binder/start python -m labkit.course.cli doctor
bash binder/start python -c "import labkit; assert labkit.profile().name == 'ci'; print('binder: profile ci, environment ready in', '$work')"
