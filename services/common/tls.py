"""TLS on the public port, mTLS between the mesh's services (`--tls-cert`, `--tls-key`, `--tls-ca`).

- A server with `--tls-cert` and `--tls-key` serves TLS only. The vision and the llm, given
  `--tls-ca` too, also require the caller's certificate to be signed by that CA (mTLS): a
  caller outside the mesh cannot reach them. The gateway's public port never asks users for a
  certificate (they authenticate with API keys, services/gateway/tenants.py).
- A service's own calls (gateway -> vision and llm, llm -> vision, the launcher's health
  checks and warm-up) verify the peer against `--tls-ca` and present the service's
  certificate. Without `--tls-ca` they are plaintext.

One certificate per mesh is enough: its SANs name the hosts and it is good for both server and
client authentication (`vlmesh up --tls-throwaway-ca` makes such a one, services/launcher/certs.py).
"""

from __future__ import annotations

from pathlib import Path

import grpc


def _read(path: str, flag: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as err:
        raise ValueError(f"{flag} {path}: cannot read it: {err.strerror or err}") from None


def check_files(cert: str, key: str, ca: str) -> None:
    """ValueError naming the flag: a cert without its key (or a key without its cert), a CA without
    them, or a file that cannot be read or holds no PEM."""
    if bool(cert) != bool(key):
        raise ValueError("--tls-cert and --tls-key go together: give both, or neither")
    if ca and not cert:
        raise ValueError("--tls-ca needs --tls-cert and --tls-key (the service's own certificate for mTLS)")
    for flag, path in (("--tls-cert", cert), ("--tls-key", key), ("--tls-ca", ca)):
        if path and b"-----BEGIN " not in _read(path, flag):
            raise ValueError(f"{flag} {path}: not a PEM file")


def server_credentials(cert: str, key: str, ca: str, require_client: bool) -> grpc.ServerCredentials | None:
    """TLS for a server (None: plaintext); with `require_client` and a CA, callers need a certificate it signed."""
    if not cert:
        return None
    pair = [(_read(key, "--tls-key"), _read(cert, "--tls-cert"))]
    if require_client and ca:
        return grpc.ssl_server_credentials(pair, root_certificates=_read(ca, "--tls-ca"), require_client_auth=True)
    return grpc.ssl_server_credentials(pair)


def channel_credentials(cert: str, key: str, ca: str) -> grpc.ChannelCredentials | None:
    """For calls to the mesh's own services: verify them against the CA, present this certificate (None: plaintext)."""
    if not ca:
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=_read(ca, "--tls-ca"),
        private_key=_read(key, "--tls-key") if key else None,
        certificate_chain=_read(cert, "--tls-cert") if cert else None,
    )


def aio_channel(target: str, creds: grpc.ChannelCredentials | None, **kw) -> grpc.aio.Channel:
    """A grpc.aio channel, secure with `creds`, else plaintext (kw: options, interceptors)."""
    if creds is None:
        return grpc.aio.insecure_channel(target, **kw)
    return grpc.aio.secure_channel(target, creds, **kw)


def sync_channel(target: str, creds: grpc.ChannelCredentials | None, **kw) -> grpc.Channel:
    """A blocking channel, secure with `creds`, else plaintext (kw: options)."""
    if creds is None:
        return grpc.insecure_channel(target, **kw)
    return grpc.secure_channel(target, creds, **kw)
