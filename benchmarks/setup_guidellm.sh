#!/usr/bin/env bash
# guidellm (vLLM's LLM serving benchmark) in a virtual environment of its own, benchmarks/.guidellm-venv,
# for benchmarks/openai_api.py. The CPU wheel of PyTorch goes first, pinned: guidellm would otherwise
# pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")"
VENV=.guidellm-venv
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "torch==2.13.0"
"$VENV/bin/python" -m pip install -q "guidellm==0.8.1"
echo "==> $("$VENV/bin/guidellm" --version)"
