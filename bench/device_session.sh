#!/usr/bin/env bash
# One device lease, prepared (issue 17): what the 2-core development machine cannot show.
#
# The lent machine (one H200, 16 cores, no network, torch in its image, none of resild's
# own dependencies) runs the checks in two commands of under 5 minutes each, so that a
# whole lease (15 minutes with the machine's start) holds both and a rerun of one:
#
#   here, once:   bash bench/device_session.sh prepare   # wheels the image lacks -> .whl/ (git-ignored)
#   there:        bash bench/device_session.sh gpu       # bench/gpu_check.py: the NCCL/CUDA paths
#   there:        bash bench/device_session.sh cores     # the CPU benches with a core per process
#
# (the device tool's `run`, with carry [".whl"]; results land in $OUT, else ./device-out).
# `cores` is what 2 shared cores blur: the failure-free step time under resild against plain
# torchrun (the 5% target), the 16,000-rank announcement (the 50 ms target, receivers on
# cores of their own) and the replay bandwidth; nothing there needs the GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"

setup() {
    if compgen -G ".whl/*.whl" >/dev/null; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
        export PYTHONPATH=/tmp/site:$PWD
    else
        export PYTHONPATH=$PWD
    fi
    export PYTHONUNBUFFERED=1
    "$PY" -c "import torch, zmq, hostlist; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'cores', __import__('os').cpu_count())"
}

case "${1:-}" in
prepare)
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >>.git/info/exclude
    mkdir -p .whl
    # The image's Python is 3.12; pure-Python wheels match any platform.
    for pkg in pyzmq==27.3.0 torchdata==0.11.0 zlib-ng==1.1.0; do
        python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
            -d .whl "$pkg"
    done
    python3 -m pip wheel -q --no-deps -w .whl python-hostlist==2.3.0 # an sdist only: pure Python, built here
    ls -l .whl
    ;;
gpu)
    setup
    timeout 290 "$PY" bench/gpu_check.py --budget-s 270 >"$OUT/gpu_check.json" 2>"$OUT/gpu_check.log" || true
    tail -c 4000 "$OUT/gpu_check.json"
    ;;
cores)
    setup
    # each bench bounded, so that one hang leaves the others' results
    timeout 240 "$PY" bench/sharded.py --only overhead --repeats 2 --json >"$OUT/overhead.json" 2>"$OUT/overhead.log" || true
    timeout 90 "$PY" bench/controller_scale.py --nodes 2000 --failures 3 --heartbeat-timeout 10 --json \
        >"$OUT/controller_scale.json" 2>"$OUT/controller_scale.log" || true
    timeout 40 "$PY" bench/replay_bandwidth.py --mb 64 --sources 1 2 --runs 7 \
        --paths loopback loopback_fresh direct direct_spare direct_spare_warm --json \
        >"$OUT/replay.json" 2>"$OUT/replay.log" || true
    tail -n 4 "$OUT"/overhead.json "$OUT"/controller_scale.json "$OUT"/replay.json
    ;;
*)
    echo "usage: bash bench/device_session.sh prepare|gpu|cores   (see the comment at its top)" >&2
    exit 2
    ;;
esac
