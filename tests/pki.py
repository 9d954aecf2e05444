"""A throwaway PKI for tests (the `openssl` CLI): a CA, and server or client certificates it signs."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path


class NoOpenssl(RuntimeError):
    """No `openssl` CLI to make certificates with."""


def _openssl(*args: str, cwd: Path) -> None:
    if shutil.which("openssl") is None:
        raise NoOpenssl("no `openssl` CLI to make the test certificates")
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_ca(d: Path, name: str) -> tuple[Path, Path]:
    """A throwaway CA (EC P-256, 2 days): (certificate, key) files `d/name.crt`, `d/name.key`."""
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.crt", "-days", "2", "-subj", f"/CN={name}",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
             cwd=d)
    return d / f"{name}.crt", d / f"{name}.key"


def make_leaf(d: Path, name: str, ca: str, usage: str, san: str = "") -> tuple[Path, Path]:
    """A certificate signed by the CA `d/<ca>.crt` for usage serverAuth or clientAuth: (certificate, key)."""
    _openssl("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
    ext = ["basicConstraints=CA:FALSE", "keyUsage=critical,digitalSignature,keyEncipherment",
           f"extendedKeyUsage={usage}"]
    if san:
        ext.append(f"subjectAltName={san}")
    (d / f"{name}.ext").write_text("\n".join(ext) + "\n")
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key", "-CAcreateserial",
             "-out", f"{name}.crt", "-days", "2", "-extfile", f"{name}.ext", cwd=d)
    return d / f"{name}.crt", d / f"{name}.key"
