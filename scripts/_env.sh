# Sourced by scripts/demo and scripts/test: creates or refreshes .venv in the repo and
# installs rlcomm with its extras. Only Python >= 3.10 and pip are needed beforehand.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  echo "[rlcomm] creating .venv" >&2
  "$PY" -m venv .venv
fi
VPY="$ROOT/.venv/bin/python"
STAMP=".venv/.rlcomm-installed"
WANT="$(cat pyproject.toml setup.py scripts/_env.sh rlcomm/comm/transports/*.c | "$VPY" -c 'import hashlib,sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())')"
if [ "$(cat "$STAMP" 2>/dev/null || true)" != "$WANT" ]; then
  echo "[rlcomm] installing dependencies into .venv (first run takes a few minutes)" >&2
  "$VPY" -m pip install -q --upgrade pip >&2
  # A CPU build of torch 2.13.0 is cached on the development machines; an open range
  # would download a multi-GB CUDA build. Users who have torch keep theirs.
  if ! "$VPY" -c 'import torch' 2>/dev/null; then
    "$VPY" -m pip install -q "torch==2.13.0" >&2
  fi
  "$VPY" -m pip install -q -e ".[test,examples]" >&2
  echo "$WANT" > "$STAMP"
fi
export PATH="$ROOT/.venv/bin:$PATH"
export RAY_USAGE_STATS_ENABLED=0
