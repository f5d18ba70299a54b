#!/usr/bin/env bash
# Download, where there is network, the wheels scripts/gpu/check.sh installs on an offline GPU machine:
# every distribution `python -m benchmarks.gpu_check wheels` lists (replayjob's own dependencies that
# such a machine may lack, pytest and its dependencies, and setuptools to build replayjob), pinned,
# without their dependencies, for the GPU machine's Python and platform.  torch, transformers, peft
# and numpy are never fetched: the machine's builds are used.  About 4.5 MiB in all (11 wheels).
#
# Usage: scripts/gpu/fetch-wheels.sh [DIR]
#   DIR   where the wheels go (default scripts/gpu/wheels, git-ignored; the folder check.sh reads)
# Environment: GPU_PYTHON_VERSION (default 3.12), GPU_PLATFORMS (default "manylinux_2_28_x86_64
#   manylinux2014_x86_64": what torch's own Linux wheels need, so any machine running them takes these).
# When an interpreter of GPU_PYTHON_VERSION is found (GPU_CHECK_PYTHON, else python3.12 on PATH), every
# wheel is then installed into a scratch folder with it and imported, so one that would not load fails here.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
DEST="$(realpath -m "${1:-$REPO/scripts/gpu/wheels}")"
PYVER="${GPU_PYTHON_VERSION:-3.12}"
read -r -a PLATFORMS <<< "${GPU_PLATFORMS:-manylinux_2_28_x86_64 manylinux2014_x86_64}"
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x "$REPO/.venv/bin/python" ]; then PY="$REPO/.venv/bin/python"; else PY="$(command -v python3)"; fi
fi

cd "$REPO"
mapfile -t SPECS < <("$PY" -m benchmarks.gpu_check wheels)
PLATFORM_ARGS=()
for p in "${PLATFORMS[@]}"; do PLATFORM_ARGS+=(--platform "$p"); done
mkdir -p "$DEST"
echo "fetch-wheels: ${#SPECS[@]} distributions for Python $PYVER (${PLATFORMS[*]}) into $DEST"
"$PY" -m pip download --dest "$DEST" --no-deps --only-binary=:all: --python-version "$PYVER" \
  --implementation cp "${PLATFORM_ARGS[@]}" "${SPECS[@]}"

# Every pinned distribution has exactly one wheel of its version in DEST (an older fetch's other versions
# are left alone: check.sh installs by exact version).
"$PY" - "$DEST" "${SPECS[@]}" <<'EOF'
import sys
from pathlib import Path

from benchmarks.gpu_check import find_wheel

dest = Path(sys.argv[1])
for spec in sys.argv[2:]:
    print(f"  {find_wheel(dest, spec).name}")
EOF

CHECK_PY="${GPU_CHECK_PYTHON:-$(command -v "python$PYVER" || true)}"
if [ -n "$CHECK_PY" ] && "$CHECK_PY" -c 'import sys; sys.exit(0 if sys.version_info[:2] == tuple(map(int, sys.argv[1].split("."))) else 1)' "$PYVER" 2> /dev/null; then
  SCRATCH="$(mktemp -d)"
  trap 'rm -rf "$SCRATCH"' EXIT
  env -u PIP_FIND_LINKS -u PIP_INDEX_URL -u PIP_EXTRA_INDEX_URL -u PIP_CONSTRAINT PIP_CONFIG_FILE=/dev/null PIP_ROOT_USER_ACTION=ignore \
    "$CHECK_PY" -m pip install -q --no-index --find-links "$DEST" --no-deps --no-cache-dir --target "$SCRATCH" \
    "${SPECS[@]}"
  PYTHONPATH="$SCRATCH" "$CHECK_PY" -c 'import docopt, iniconfig, msgspec, packaging, pluggy, pygments, pytest
import safetensors, setuptools, yaml
print("fetch-wheels: every wheel installs and imports under Python", ".".join(map(str, __import__("sys").version_info[:3])))'
else
  echo "fetch-wheels: no python$PYVER here; the wheels were not test-installed"
fi
echo "fetch-wheels: $(du -sh "$DEST" | cut -f1) in $DEST"
