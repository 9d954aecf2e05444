"""Generated protobuf code is committed (so that installing the client needs no protoc); this
checks it is exactly what the .proto files generate today."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_generated_code_is_current(tmp_path):
    protos = sorted((ROOT / "protos" / "specdec" / "v1").glob("*.proto"))
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-I", str(ROOT / "protos"), f"--python_out={tmp_path}",
         f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}", *map(str, protos)],
        check=True,
    )
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.py*"))
    assert generated, "protoc generated nothing"
    stale = [str(p) for p in generated if (ROOT / p).read_text() != (tmp_path / p).read_text()]
    assert not stale, f"regenerate with scripts/gen_protos.sh: {stale}"


def test_client_imports_without_torch_or_server_packages():
    code = (
        "import sys; import specdec; from specdec import Client; import specdec.cli\n"
        "heavy = [m for m in ('torch', 'transformers', 'redis', 'coordinator', 'draft_service', 'target_service',"
        " 'specdec_core', 'numpy') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
