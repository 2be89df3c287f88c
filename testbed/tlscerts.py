"""Throwaway TLS material for tests: a CA, a server certificate for 127.0.0.1/localhost, a client certificate.

Made with the ``openssl`` command line (neither ``cryptography`` nor ``trustme`` is a dependency), with
the extensions a strict verifier wants (key usages, key identifiers, subjectAltName), valid for two days.
Without ``openssl`` the tests that need these files fail saying so: they never skip.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

_CONFIG = """\
[req]
distinguished_name = dn
prompt = no

[dn]

[ca]
basicConstraints = critical, CA:TRUE
keyUsage = critical, keyCertSign, cRLSign
subjectKeyIdentifier = hash

[server]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature, keyEncipherment
extendedKeyUsage = serverAuth
subjectAltName = DNS:localhost, IP:127.0.0.1
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid, issuer

[client]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature, keyEncipherment
extendedKeyUsage = clientAuth
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid, issuer
"""


@dataclass(frozen=True)
class TlsFiles:
    ca: Path  # the CA's certificate: what verifies the server's and the client's
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_key: Path  # a valid key that belongs to neither certificate


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


class OpensslUnavailable(RuntimeError):
    """The ``openssl`` command line is not on PATH."""


def make_tls_files(folder: Path) -> TlsFiles:
    if shutil.which("openssl") is None:
        raise OpensslUnavailable("the openssl command line is needed to make test certificates and is not on "
                                 "PATH (Debian: apt-get install openssl)")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "openssl.cnf").write_text(_CONFIG)
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=wds test CA",
             "-config", "openssl.cnf", "-extensions", "ca", cwd=folder)
    for name, common_name in (("server", "localhost"), ("client", "wds-etl pod")):
        _openssl("req", "-new", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={common_name}",
                 "-config", "openssl.cnf", cwd=folder)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.pem", "-days", "2", "-extfile", "openssl.cnf", "-extensions", name, cwd=folder)
    _openssl("genpkey", "-algorithm", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-out", "other.key",
             cwd=folder)
    return TlsFiles(ca=folder / "ca.pem", server_cert=folder / "server.pem", server_key=folder / "server.key",
                    client_cert=folder / "client.pem", client_key=folder / "client.key",
                    other_key=folder / "other.key")
