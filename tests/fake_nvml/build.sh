#!/bin/sh
# Builds the fake libnvidia-ml.so.1 (source: resild/health/fake_nvml.c) into DIR
# (default: tests/fake_nvml/build). Use it with:
#   LD_LIBRARY_PATH=DIR FAKE_NVML_CONTROL=/path/to/control python ...
set -eu
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-"$here/build"}
python=${PYTHON:-python3}
[ -x "$here/../../.venv/bin/python" ] && [ -z "${PYTHON:-}" ] && python="$here/../../.venv/bin/python"
"$python" -c 'import sys; from pathlib import Path; from resild.health.fakenvml import build_fake_nvml; print(build_fake_nvml(Path(sys.argv[1]), old_driver=len(sys.argv) > 2))' "$out" ${OLD_DRIVER:+old}
