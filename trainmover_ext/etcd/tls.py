"""Generate a throw-away CA, server and client certificates with the openssl CLI.

For tests and local demos of etcd's ``--client-cert-auth``; production
certificates come from the cluster's own PKI. The server certificate is valid for
``127.0.0.1`` and ``localhost``.

Example::

    certs = make_test_certs(tmp_path)
    EmbeddedEtcdConfig(..., cert_file=certs.server_cert, key_file=certs.server_key,
                       trusted_ca_file=certs.ca_cert, client_cert_auth=True)
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from trainmover_ext.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class TestCerts:
    """Paths of the generated PEM files."""

    ca_cert: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str
    other_ca_cert: str
    """A CA that signed nothing the server trusts: a client using it must be refused."""
    other_client_cert: str
    other_client_key: str


def _openssl(*args: str, cwd: Path) -> None:
    proc = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        raise ConfigError(f"openssl {' '.join(args[:2])} failed: {proc.stderr.strip()}")


def _ca(d: Path, name: str) -> None:
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "2",
        "-subj",
        f"/CN={name}",
        "-keyout",
        f"{name}.key",
        "-out",
        f"{name}.pem",
        cwd=d,
    )


def _leaf(d: Path, name: str, ca: str, *, server: bool) -> None:
    _openssl(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        f"/CN={name}",
        "-keyout",
        f"{name}.key",
        "-out",
        f"{name}.csr",
        cwd=d,
    )
    ext = d / f"{name}.ext"
    usage = "serverAuth,clientAuth" if server else "clientAuth"
    ext.write_text(f"subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage={usage}\n")
    _openssl(
        "x509",
        "-req",
        "-in",
        f"{name}.csr",
        "-CA",
        f"{ca}.pem",
        "-CAkey",
        f"{ca}.key",
        "-CAcreateserial",
        "-days",
        "2",
        "-out",
        f"{name}.pem",
        "-extfile",
        ext.name,
        cwd=d,
    )


def make_test_certs(directory: Path) -> TestCerts:
    """Write a CA, a server and a client certificate (plus an untrusted pair) into ``directory``."""
    if shutil.which("openssl") is None:
        raise ConfigError("the openssl CLI is needed to generate test certificates: apt-get install -y openssl")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    _ca(d, "ca")
    _leaf(d, "server", "ca", server=True)
    _leaf(d, "client", "ca", server=False)
    _ca(d, "otherca")
    _leaf(d, "otherclient", "otherca", server=False)
    return TestCerts(
        ca_cert=str(d / "ca.pem"),
        server_cert=str(d / "server.pem"),
        server_key=str(d / "server.key"),
        client_cert=str(d / "client.pem"),
        client_key=str(d / "client.key"),
        other_ca_cert=str(d / "otherca.pem"),
        other_client_cert=str(d / "otherclient.pem"),
        other_client_key=str(d / "otherclient.key"),
    )
