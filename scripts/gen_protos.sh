#!/usr/bin/env bash
# Regenerates the committed Python code for protos/specdec/v1/*.proto into specdec/v1/.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python -m grpc_tools.protoc -I protos --python_out=. --pyi_out=. --grpc_python_out=. protos/specdec/v1/*.proto
