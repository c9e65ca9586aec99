"""A job's own certificate authority, for ``trainmover launch --tm-etcd-tls``.

Contract:
- :func:`make_job_certs` writes, into a fresh directory of mode 700, a CA made for this
  one job, a server certificate valid for the given host names and addresses, and one
  client certificate that every member of the job presents (``--client-cert-auth``).
  Private keys are mode 600 and never leave that directory; the CA key is not kept
  after signing, so nothing can mint more certificates for the job later.
- Keys are ECDSA P-256, certificates last ``days`` (30 by default): a job that runs
  longer needs certificates from the cluster's PKI (``--tm-etcd-ca/--tm-etcd-cert/--tm-etcd-key``).
- The client certificate's subject is ``trainmover-member``, which is no etcd user, so a
  certificate alone grants nothing once auth is on: a member still logs in as the job's
  user (:mod:`trainmover_ext.etcd.auth`).

Example::

    certs = make_job_certs(run_dir / "etcd-tls", job="llama7b", hosts=["127.0.0.1", "localhost"])
    EmbeddedEtcdConfig(..., cert_file=certs.server_cert, key_file=certs.server_key,
                       trusted_ca_file=certs.ca_cert, client_cert_auth=True)
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from trainmover_ext.errors import ConfigError
from trainmover_ext.fsutil import write_private

MEMBER_SUBJECT = "trainmover-member"


@dataclass(frozen=True, kw_only=True)
class JobCerts:
    """Paths of one job's PEM files."""

    ca_cert: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str


def make_job_certs(directory: str | os.PathLike, *, job: str, hosts: list[str], days: int = 30) -> JobCerts:
    """Write the job's CA, server and member certificates (see the module docstring)."""
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
    except ImportError as exc:  # pragma: no cover - environment problem
        raise ConfigError("--tm-etcd-tls needs the cryptography package: pip install cryptography") from exc
    if not hosts:
        raise ConfigError("the etcd server certificate needs at least one host name or address")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(d, 0o700)
    now = datetime.datetime.now(datetime.UTC)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def key_pem(key) -> bytes:
        return key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = name(f"trainmover job {job} CA")
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )

    def leaf(cn: str, usages: list, sans: list | None) -> tuple[bytes, bytes]:
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (
            x509.CertificateBuilder()
            .subject_name(name(cn))
            .issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start)
            .not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        )
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        cert = builder.sign(ca_key, hashes.SHA256())
        return cert.public_bytes(serialization.Encoding.PEM), key_pem(key)

    sans: list = []
    for host in dict.fromkeys(hosts):
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            sans.append(x509.DNSName(host))
    server_cert, server_key = leaf(
        f"trainmover job {job} etcd", [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH], sans
    )
    client_cert, client_key = leaf(MEMBER_SUBJECT, [ExtendedKeyUsageOID.CLIENT_AUTH], None)
    return JobCerts(
        ca_cert=write_private(d / "ca.pem", ca.public_bytes(serialization.Encoding.PEM), 0o644),
        server_cert=write_private(d / "server.pem", server_cert, 0o644),
        server_key=write_private(d / "server.key", server_key, 0o600),
        client_cert=write_private(d / "member.pem", client_cert, 0o644),
        client_key=write_private(d / "member.key", client_key, 0o600),
    )


def main(argv: list[str] | None = None) -> int:
    """``python -m trainmover_ext.etcd.pki``: the Slurm script's job CA (``--tm-etcd-tls``)."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(
        prog="python -m trainmover_ext.etcd.pki", description="Write a job's CA, etcd server and member certificates."
    )
    parser.add_argument("--dir", required=True, help="directory to create (mode 700) for the PEM files")
    parser.add_argument("--job", required=True, help="the job name (--tm-job), named in the certificates")
    parser.add_argument(
        "--host",
        action="append",
        required=True,
        help="a name or address the etcd server is reached at (repeat for several)",
    )
    parser.add_argument("--days", type=int, default=30, help="validity in days (default 30)")
    args = parser.parse_args(argv)
    try:
        certs = make_job_certs(args.dir, job=args.job, hosts=args.host, days=args.days)
    except ConfigError as exc:
        print(f"trainmover pki: {exc}", file=sys.stderr)
        return 1
    print(f"job CA {certs.ca_cert}; etcd server {certs.server_cert}; member {certs.client_cert}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
