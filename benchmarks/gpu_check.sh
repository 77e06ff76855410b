#!/usr/bin/env bash
# The prepared GPU check, on a CUDA machine: install vLLM and this package into
# a fresh virtualenv, then serve a tiny random-weight model with the plugin and
# check the AsyncScheduler path, cudagraph padding against vLLM's own counters
# and the NVML series (benchmarks/gpu_check.py). About 5-8 minutes, most of it
# the install; the whole run is bounded by TIMEOUT_S (default 600).
#
#   bash benchmarks/gpu_check.sh [--dry-run] [--workdir DIR]
#
# Environment: VLLM_VERSION (default 0.32.0, the tested range), PIP_FIND_LINKS /
# PIP_INDEX_URL for an offline wheelhouse, PYTHON (default python3).
# Exit: 0 every check passed; 1 a check failed; 2 usage or no GPU; 3 install failed.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(dirname "$here")"
workdir="${TMPDIR:-/tmp}/vllm-runbook-gpu-check"
dry_run=0
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) dry_run=1 ;;
    --workdir) workdir="${2:?--workdir needs a directory}"; shift ;;
    *) echo "gpu_check.sh: unknown option $1 (use --dry-run, --workdir DIR)" >&2; exit 2 ;;
  esac
  shift
done

python="${PYTHON:-python3}"
vllm_version="${VLLM_VERSION:-0.32.0}"
venv="$workdir/venv"
steps=(
  "$python -m venv $venv"
  "$venv/bin/pip install --quiet vllm==$vllm_version $repo"
  "timeout ${TIMEOUT_S:-600} $venv/bin/python $here/gpu_check.py --workdir $workdir"
)

if [ "$dry_run" = 1 ]; then
  printf '%s\n' "${steps[@]}"
  exit 0
fi
if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu_check.sh: no NVIDIA GPU here (nvidia-smi fails); nothing to check" >&2
  exit 2
fi
mkdir -p "$workdir"
start=$(date +%s)
$python -m venv "$venv"
if ! "$venv/bin/pip" install --quiet "vllm==$vllm_version" "$repo"; then
  echo "gpu_check.sh: installing vllm==$vllm_version failed" >&2
  exit 3
fi
echo "installed in $(( $(date +%s) - start )) s; vLLM $("$venv/bin/python" -c 'import vllm; print(vllm.__version__)')"
left=$(( ${TIMEOUT_S:-600} - ($(date +%s) - start) ))
set +e
# PATH: `vllm serve` is the venv's.
PATH="$venv/bin:$PATH" timeout "$(( left > 60 ? left : 60 ))" \
  "$venv/bin/python" "$here/gpu_check.py" --workdir "$workdir"
code=$?
set -e
echo "total $(( $(date +%s) - start )) s"
[ "$code" = 124 ] && echo "gpu_check.sh: timed out" >&2
exit "$code"
