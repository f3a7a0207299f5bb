#!/bin/sh
# Install Headroom's router and worker as login services (launchd on macOS, systemd on
# Linux). Run from the venv that has mlx-headroom installed; extra arguments are passed on,
# e.g.:  deploy/install.sh --model ~/models/Qwen3-4B-4bit --port 8080 [--system] [--dry-run]
set -eu
here="$(cd "$(dirname "$0")/.." && pwd)"
exec "${MLX_ROUTER:-$here/.venv/bin/mlx-router}" service install "$@"
