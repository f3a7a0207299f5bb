#!/usr/bin/env bash
# On the lent GPU machine (see bench/README.md, "On the lent GPU"), from the checkout's root:
#
#   bash bench/gpu_run.sh stash                    # call 1, carry [".whl/a"]: park the first half
#   bash bench/gpu_run.sh install [PART...] [-- SERVE_ARGS]
#                                                  # call 2, carry [".whl/b"]: join, install, run
#   bash bench/gpu_run.sh [PART...] [-- SERVE_ARGS]   # later calls on the same warm machine
#
# PART: info build shape runtime ttft faults split memory profile agents serve cpuprofile (python -m bench.gpu_run
# --help). Results go to $OUT.
# WHL (default .whl, relative to the current directory) is where the carried wheels are;
# the code run is the checkout this script lives in.
set -uo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
whl="${WHL:-.whl}"
cuda_whl=/root/mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl

case "${1:-}" in
  stash)
    mkdir -p /root/stash && cp "$whl"/a/part-aa /root/stash/ && echo "stashed $(du -h /root/stash/part-aa)"
    exit $?
    ;;
  install)
    shift
    if ! python3 -c 'import mlx.core, mlx_lm, zmq' 2>/dev/null; then
      [ -f /root/stash/part-aa ] || { echo "no /root/stash/part-aa: a fresh machine; run 'stash' first" >&2; exit 3; }
      cat /root/stash/part-aa "$whl"/b/part-ab > "$cuda_whl" || exit 3
      python3 -m pip install -q --no-index --no-deps --no-compile "$cuda_whl" "$whl"/b/*.whl || exit 3
    fi
    # llguidance (constrained decoding) travels in .whl/c. The image may hold an older one:
    # whatever is older than pyproject's floors is replaced (an llguidance 1.6.1 left there
    # failed every grammar request), checked by the worker's own rule.
    if ! (cd "$here" && python3 -c 'import sys; from worker.requirements import too_old; sys.exit(bool(too_old()))'); then
      python3 -m pip install -q --no-index --no-deps --no-compile --force-reinstall "$whl"/c/*.whl || exit 3
    fi
    # py-spy (the cpuprofile and profile parts) travels in .whl/d, when carried.
    if [ -d "$whl/d" ] && ! command -v py-spy >/dev/null; then
      python3 -m pip install -q --no-index --no-deps --no-compile "$whl"/d/*.whl || exit 3
    fi
    ;;
esac
(cd "$here" && python3 -c 'import sys; from worker.requirements import too_old; p = too_old(); print("too old:", p) if p else None; sys.exit(bool(p))') || exit 3
python3 -c 'import mlx.core as mx; print("mlx", mx.__version__, mx.default_device(), mx.device_info())' || exit 3
[ $# -eq 0 ] && exit 0
cd "$here" && PYTHONUNBUFFERED=1 exec python3 -m bench.gpu_run "$@"
