#!/usr/bin/env bash
# Run the labs on a lent GPU machine with the `gpu` profile, inside one device call.
#
#   bash benchmarks/device_run.sh WHEELS OUT SECONDS LABS_A [LABS_B]
#
# WHEELS: a folder of wheels for what the machine lacks. They go, with --no-deps, into
#   /tmp/device-run-site/<folder name without dots>, where a later call on the same warm
#   machine still finds them (Daft's 56 MB wheel needs a call of its own: 64 MiB a call).
# OUT: where the executed notebooks (runs.tar.gz), reports, probe and logs go.
# SECONDS: the whole budget; a lab still running then is stopped, and keeps the cells it ran.
# LABS_A, LABS_B: two streams run side by side, each in order: lab numbers, "dsops" (build
#   DeepSpeed's ops) or "terms" (benchmarks/lab01_gpu_terms.py). Device time is minutes, so
#   the GPU labs and the rank labs (gloo ranks on CPU cores) share it; timings of labs that
#   ran side by side are not a sequential course time.
# Rehearse here first: PYTHON=.venv/bin/python LABKIT_PROFILE=ci bash benchmarks/device_run.sh none /tmp/out 250 "terms 3"
set -uo pipefail
wheels=$1 out=$2 budget=$3 labs_a=$4 labs_b=${5:-}
cd "$(dirname "$0")/.."
start=$SECONDS
site=/tmp/device-run-site
mkdir -p "$out" "$site"
target="$site/$(basename "$wheels" | tr -d .)"
export PYTHONPATH="$PWD:$(ls -d $site/*/ 2>/dev/null | tr '\n' ':')$target"
export PYTHONUNBUFFERED=1 MPLBACKEND=Agg DAFT_ANALYTICS_ENABLED=0
export LABKIT_PROFILE=${LABKIT_PROFILE:-gpu} LABKIT_DATA="$PWD/data" TORCH_EXTENSIONS_DIR=/tmp/device-run-torch-extensions
py=${PYTHON:-python3}

if compgen -G "$wheels/*.whl" >/dev/null; then
  # one folder per wheel set: pip --target --upgrade replaced the whole folder of an earlier set
  $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$target" "$wheels"/*.whl \
    >"$out/install.log" 2>&1 || { echo "wheel install failed"; tail -20 "$out/install.log"; }
fi

{
  date -u; nproc; free -g | head -2; nvidia-smi -L 2>&1
  for tool in ip tc g++ ninja nvcc; do printf '%s: %s\n' "$tool" "$(command -v $tool || echo missing)"; done
  $py - <<'EOF'
import importlib, platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-")
for name in ("deepspeed", "daft", "nbclient", "ipykernel", "liger_kernel", "pyarrow", "triton"):
    try:
        module = importlib.import_module(name)
        print(name, getattr(module, "__version__", "?"))
    except Exception as exc:  # the probe reports what is missing instead of stopping
        print(name, "MISSING", type(exc).__name__, exc)
from labkit import netns, profiles
print("profile", profiles.profile())
print("can_shape:", netns.can_shape() or "yes")
EOF
} >"$out/probe.log" 2>&1
cat "$out/probe.log"

left() { echo $(( budget - (SECONDS - start) )); }

stream() {  # run labs in order, each capped by what is left of the budget
  local name=$1; shift
  for lab in "$@"; do
    local cap; cap=$(left)
    if (( cap < 20 )); then echo "[$name] lab $lab skipped: ${cap}s left"; continue; fi
    echo "[$name] lab $lab starts at +$((SECONDS - start))s, cap ${cap}s"
    if [ "$lab" = dsops ]; then
      timeout -s TERM "$cap" $py -m labkit.dsops ShareMemCommBuilder CPUAdamBuilder 2>&1 | tail -5
    elif [ "$lab" = terms ]; then
      timeout -s TERM "$cap" $py benchmarks/lab01_gpu_terms.py 2>&1 | tail -40
    else
      timeout -s TERM -k 20 "$cap" $py -m labkit.course.cli run "$lab" --profile "$LABKIT_PROFILE" \
        --out "runs/device/lab$lab" 2>&1 | grep -v "it/s\]$" | tail -40
    fi
    echo "[$name] lab $lab ended at +$((SECONDS - start))s"
  done
}

stream A $labs_a >"$out/stream-a.log" 2>&1 &
if [ -n "$labs_b" ]; then stream B $labs_b >"$out/stream-b.log" 2>&1 & fi
wait
cat "$out"/stream-*.log
tar -czf "$out/runs.tar.gz" -C runs device 2>/dev/null
cat runs/device/*/report.md 2>/dev/null | grep -E "^\| [0-9]"
echo "device_run: done in $((SECONDS - start))s"
