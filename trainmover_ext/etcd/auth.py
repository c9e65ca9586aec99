"""Give a job its own etcd user, and turn etcd's authentication on.

Contract:
- :func:`provision_job` creates (or updates) the job's role ``tm-<job>``, allowed to
  read and write ``/trainmover/<job>/`` and nothing else, and the user ``tm-<job>``
  with that role and the password derived from the job token
  (:func:`~trainmover_ext.kv.job.job_password`). It is idempotent: a second call
  with the same job and token changes nothing; with another token it sets the new
  password (the old token then logs in no more).
- With ``enable=True`` on a server whose auth is off, it first creates ``root``
  (role ``root``) with a fresh random password, then enables auth, and returns that
  password: keep it (the launcher writes it to ``<run dir>/etcd-root-password``,
  mode 600) to administer the server. On a server whose auth is already on it needs
  ``admin`` credentials (a user with the root role).
- It talks to etcd's HTTP/JSON gateway (``/v3/auth/...``) with the standard library,
  never gRPC: the launcher calls it before it forks ranks, and a gRPC channel must not
  cross ``fork()``. Every request has a timeout; a refusal is an :class:`AuthError`,
  an unreachable server :class:`EtcdUnavailable`.

Example::

    root_password = provision_job(etcd.client_url, "llama7b", token, enable=True)
"""

from __future__ import annotations

import base64
import json
import secrets
import ssl
import urllib.error
import urllib.request
from dataclasses import dataclass

from trainmover_ext.errors import AuthError, EtcdUnavailable
from trainmover_ext.fsutil import write_private
from trainmover_ext.kv.base import prefix_end
from trainmover_ext.kv.job import job_password, job_root, job_user

ROOT_USER = "root"
TIMEOUT_S = 5.0
"""Deadline of each gateway request."""


@dataclass(frozen=True, kw_only=True)
class GatewayTLS:
    """How to reach an https gateway: the CA that signed the server, and a client pair where
    the server wants client certificates."""

    ca_cert: str
    client_cert: str | None = None
    client_key: str | None = None

    def context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=self.ca_cert)
        if self.client_cert:
            ctx.load_cert_chain(self.client_cert, self.client_key)
        return ctx


class _Gateway:
    def __init__(self, url: str, tls: GatewayTLS | None) -> None:
        self.url = url.rstrip("/")
        self.ctx = tls.context() if tls else None
        self.token: str | None = None

    def call(self, path: str, body: dict, *, exists_ok: bool = False) -> dict | None:
        """POST ``body`` to ``/v3/<path>``; None when ``exists_ok`` and the thing already existed."""
        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["Authorization"] = self.token
        req = urllib.request.Request(
            f"{self.url}/v3/{path}", data=json.dumps(body).encode(), headers=headers, method="POST"
        )
        try:
            with urllib.request.urlopen(req, timeout=TIMEOUT_S, context=self.ctx) as resp:
                return json.loads(resp.read() or b"{}")
        except urllib.error.HTTPError as exc:
            detail = _error(exc)
            if exists_ok and "already exists" in detail:
                return None
            raise AuthError(f"etcd refused {path}: {detail}") from exc
        except (urllib.error.URLError, OSError) as exc:
            raise EtcdUnavailable(f"etcd at {self.url} did not answer {path}: {exc}") from exc

    def auth_enabled(self) -> bool:
        """Whether the server's auth is on: an anonymous read is refused then."""
        try:
            self.call("kv/range", {"key": _b64("/trainmover/.probe")})
            return False
        except AuthError:
            return True

    def login(self, user: str, password: str) -> None:
        self.token = (self.call("auth/authenticate", {"name": user, "password": password}) or {})["token"]


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _error(exc: urllib.error.HTTPError) -> str:
    try:
        return str(json.loads(exc.read() or b"{}").get("error") or exc.reason)
    except (ValueError, OSError):
        return str(exc.reason)


def provision_job(
    url: str,
    job: str,
    token: str,
    *,
    enable: bool = False,
    admin: tuple[str, str] | None = None,
    tls: GatewayTLS | None = None,
) -> str | None:
    """Create the job's etcd user and role (see the module docstring); returns the new root
    password when this call enabled auth, else None."""
    gw = _Gateway(url, tls)
    root_password = None
    if gw.auth_enabled():
        if admin is None:
            raise AuthError(
                f"etcd at {url} has auth on: creating job {job!r}'s etcd user needs an admin login "
                "(--tm-etcd-user root with its password in TRAINMOVER_ETCD_PASSWORD)"
            )
        gw.login(*admin)
    elif admin is not None:
        raise AuthError(
            f"etcd at {url} has auth off, yet an admin login was given: turn auth on first "
            "(`etcdctl auth enable`), or omit --tm-etcd-user to let the launcher do it"
        )
    elif enable:
        root_password = secrets.token_hex(32)
        gw.call("auth/role/add", {"name": ROOT_USER}, exists_ok=True)
        gw.call("auth/user/add", {"name": ROOT_USER, "password": root_password})
        gw.call("auth/user/grant", {"user": ROOT_USER, "role": ROOT_USER})
    user, root = job_user(job), job_root(job)
    gw.call("auth/role/add", {"name": user}, exists_ok=True)
    gw.call(
        "auth/role/grant",
        {"name": user, "perm": {"permType": "READWRITE", "key": _b64(root), "range_end": _b64(prefix_end(root))}},
    )
    password = job_password(job, token)
    if gw.call("auth/user/add", {"name": user, "password": password}, exists_ok=True) is None:
        gw.call("auth/user/changepw", {"name": user, "password": password})
    gw.call("auth/user/grant", {"user": user, "role": user})
    if root_password is not None:
        gw.call("auth/enable", {})
    return root_password


def main(argv: list[str] | None = None) -> int:
    """``python -m trainmover_ext.etcd.auth``: turn auth on for a job's fresh etcd (the Slurm script's).

    The token comes from ``TRAINMOVER_JOB_TOKEN``, never the command line."""
    import argparse
    import os
    import sys

    parser = argparse.ArgumentParser(
        prog="python -m trainmover_ext.etcd.auth",
        description="Create a job's etcd user and role and turn etcd's auth on.",
    )
    parser.add_argument("--url", required=True, help="the etcd client URL, http(s)://host:port")
    parser.add_argument("--job", required=True, help="the job name (--tm-job)")
    parser.add_argument(
        "--root-password-file", required=True, help="where to write the new root password (created with mode 600)"
    )
    parser.add_argument("--ca", default=None, help="CA certificate of an https etcd")
    parser.add_argument("--cert", default=None, help="client certificate, where etcd wants one")
    parser.add_argument("--key", default=None, help="private key of --cert")
    args = parser.parse_args(argv)
    token = os.environ.get("TRAINMOVER_JOB_TOKEN")
    if not token:
        parser.error("set TRAINMOVER_JOB_TOKEN to the job token")
    tls = GatewayTLS(ca_cert=args.ca, client_cert=args.cert, client_key=args.key) if args.ca else None
    try:
        root_password = provision_job(args.url, args.job, token, enable=True, tls=tls)
    except (AuthError, EtcdUnavailable) as exc:
        print(f"trainmover etcd auth: {exc}", file=sys.stderr)
        return 1
    write_private(args.root_password_file, f"{root_password}\n")
    print(
        f"etcd auth on: user {job_user(args.job)} may use /trainmover/{args.job}/ only; "
        f"root password in {args.root_password_file}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
