"""`vlmesh up --tls-throwaway-ca`: a CA made for one run, and one certificate it signs for the
mesh's three services (server and client authentication both), in the run's directory.

For local use only: the CA's key lives as long as the run, and nothing outside this machine
trusts it. A deployment brings its own certificates (`--tls-cert`, `--tls-key`, `--tls-ca`;
deploy/README.md).
"""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
import os
import socket
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

LOCAL_NAMES = ("localhost", "127.0.0.1", "::1", "0.0.0.0")
VALID_FOR = datetime.timedelta(days=7)


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _san(hosts: list[str]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    for host in dict.fromkeys(hosts):  # in order, once each
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host.strip("[]"))))
        except ValueError:
            names.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(names)


def _write(path: Path, data: bytes, private: bool = False) -> str:
    path.write_bytes(data)
    if private:
        os.chmod(path, 0o600)
    return str(path)


def make_throwaway(directory: Path, hosts: list[str]) -> tuple[str, str, str]:
    """Write ca.pem, mesh.pem and mesh-key.pem into `directory`; return (cert, key, ca) paths.

    The certificate names `hosts` and the local names (localhost, the loopback addresses, this
    host's name) as subject alternative names.
    """
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(_name("vlmesh throwaway CA"))
        .issuer_name(_name("vlmesh throwaway CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + VALID_FOR)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name("vlmesh"))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + VALID_FOR)
        .add_extension(_san([*hosts, *LOCAL_NAMES, socket.gethostname()]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    key_pem = key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    return (
        _write(directory / "mesh.pem", cert.public_bytes(pem)),
        _write(directory / "mesh-key.pem", key_pem, private=True),
        _write(directory / "ca.pem", ca.public_bytes(pem)),
    )


def with_tls(opts, cert: str, key: str, ca: str):
    """MeshOptions with the three services' --tls-cert, --tls-key and --tls-ca set."""

    def tls(cfg):
        return dataclasses.replace(cfg, server=dataclasses.replace(cfg.server, tls_cert=cert, tls_key=key, tls_ca=ca))

    return dataclasses.replace(opts, gateway=tls(opts.gateway), vision=tls(opts.vision), llm=tls(opts.llm))
