"""The certificates and keys of a secure Flower deployment (``lightning-dp flower-keys``).

A consortium's deployment needs two things Flower checks but does not make:

- **TLS** on the SuperLink's one port (the nodes' Fleet API, ``flwr``'s Control API and the ServerApp's runtime
  API): a certificate authority (CA) whose certificate every party trusts, and the SuperLink's certificate for the
  addresses the parties reach it at (``flower-superlink --ssl-ca-certfile --ssl-certfile --ssl-keyfile``;
  ``flower-supernode --root-certificates``; ``root-certificates`` of the ``flwr`` connection).
- **SuperNode authentication** (``flower-superlink --enable-supernode-auth``): every site's key pair, an elliptic
  curve on a NIST curve in OpenSSH format (what Flower 1.42 loads); the operator registers each site's public key
  (``flwr supernode register``), the site starts its SuperNode with the private key
  (``--auth-supernode-private-key``). A node whose key is not registered is refused before it is given any message.

Flower's own docs make these with ``openssl`` and ``ssh-keygen`` shell scripts; here they are made with the
``cryptography`` package Flower already depends on, so the one command works wherever ``lightning-dp`` does, and
each party makes only its own secrets: the server's operator the CA and the SuperLink's certificate, every site its
own key pair (its private key never leaves its machine). docs/federated.md, "A consortium's deployment".
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Sequence
from pathlib import Path

__all__ = ["CA_CERT", "CA_KEY", "NODE_KEY", "NODE_PUB", "SERVER_CERT", "SERVER_KEY", "write_server", "write_site"]

#: the files written (relative to ``out``): what each party keeps or receives (docs/federated.md)
CA_CERT = "ca.pem"  # public: every site and whoever runs flwr needs it
CA_KEY = "ca.key"  # secret: issues certificates; keep it off the network once the server's certificate is made
SERVER_CERT = "superlink.pem"  # public
SERVER_KEY = "superlink.key"  # secret: the SuperLink's machine only
NODE_KEY = "node.key"  # secret: the site's machine only
NODE_PUB = "node.key.pub"  # public: sent to the operator, who registers it

#: addresses the SuperLink's certificate always names: its own ServerApp connects to 127.0.0.1 (Flower replaces a
#: bind-all --host with it), and localhost trials use them
_LOCAL = ("localhost", "127.0.0.1", "::1")


def _write(path: Path, data: bytes, *, secret: bool) -> None:
    if path.exists():
        raise ValueError(f"{path} exists: lightning-dp flower-keys never overwrites a key or certificate (a new key "
                         "would lock out the parties that trust the old one). Remove it first, or write to another "
                         "--out.")
    path.parent.mkdir(parents=True, exist_ok=True)
    # a secret is created readable by its owner only (no window in which others could read it)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if secret else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _check_days(days: int) -> None:
    if isinstance(days, bool) or not isinstance(days, int) or days < 1:
        raise ValueError(f"days={days!r} is not allowed: pass the number of days the certificates are valid (>= 1)")


def _san(hosts: Sequence[str]) -> list:
    from cryptography import x509

    names: list = []
    for host in dict.fromkeys([*hosts, *_LOCAL]):  # order kept, duplicates dropped
        host = str(host).strip()
        if not host or (any(c in host for c in " /:@") and not _is_ip(host)):
            raise ValueError(f"--server-host {host!r} is not a host name or an IP address: give the name or address "
                             "the sites and flwr reach the SuperLink at, without a port (e.g. link.example.org)")
        names.append(x509.IPAddress(ipaddress.ip_address(host)) if _is_ip(host) else x509.DNSName(host))
    return names


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def write_server(out: str | Path, hosts: Sequence[str], *, days: int = 365, name: str = "lightning-dp") -> list[Path]:
    """Make the consortium's CA and the SuperLink's TLS certificate under ``out``; return the files written.

    Args:
        out: the folder (created). ``superlink.pem``, ``superlink.key`` and ``ca.pem`` go to the SuperLink's
            machine; ``ca.pem`` to every site and to whoever runs ``flwr``; ``ca.key`` stays offline.
        hosts: the host names or IP addresses the sites and ``flwr`` use to reach the SuperLink (the certificate
            names them; a connection to any other name fails); ``localhost``, ``127.0.0.1`` and ``::1`` are added.
        days: how long the certificates are valid.
        name: the consortium's name in the certificates' subjects.

    Raises:
        ValueError: a host that is neither a name nor an address, no host, ``days`` < 1, or a file that exists.
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    _check_days(days)
    if not hosts:
        raise ValueError("no --server-host: give the name or address the sites reach the SuperLink at")
    out = Path(out)
    for file in (CA_CERT, CA_KEY, SERVER_CERT, SERVER_KEY):  # refuse before writing anything
        if (out / file).exists():
            _write(out / file, b"", secret=True)
    san = _san(hosts)
    now = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(minutes=5)  # clocks differ a little
    until = now + datetime.timedelta(days=days)
    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, name),
                         x509.NameAttribute(NameOID.COMMON_NAME, f"{name} deployment CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now).not_valid_after(until)
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                       data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
                                       encipher_only=False, decipher_only=False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA384()))
    key = ec.generate_private_key(ec.SECP384R1())
    server = (x509.CertificateBuilder()
              .subject_name(x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, name),
                                       x509.NameAttribute(NameOID.COMMON_NAME, str(hosts[0]).strip())]))
              .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
              .not_valid_before(now).not_valid_after(until)
              .add_extension(x509.SubjectAlternativeName(san), critical=False)
              .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
              .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
              .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
              .sign(ca_key, hashes.SHA384()))
    pem, raw = serialization.Encoding.PEM, serialization.NoEncryption()
    files = [(CA_CERT, ca.public_bytes(pem), False),
             (CA_KEY, ca_key.private_bytes(pem, serialization.PrivateFormat.PKCS8, raw), True),
             (SERVER_CERT, server.public_bytes(pem), False),
             (SERVER_KEY, key.private_bytes(pem, serialization.PrivateFormat.PKCS8, raw), True)]
    for file, data, secret in files:
        _write(out / file, data, secret=secret)
    return [out / file for file, _, _ in files]


def write_site(out: str | Path, site: str) -> list[Path]:
    """Make site ``site``'s SuperNode key pair under ``out/site``; return ``[private key, public key]``.

    The private key (``node.key``, OpenSSH, an ECDSA key on NIST P-384) stays on the site's machine
    (``flower-supernode --auth-supernode-private-key``); the public key (``node.key.pub``) goes to the SuperLink's
    operator, who registers it (``flwr supernode register``).

    Raises:
        ValueError: a site name that is not a plain folder name, or a key that exists.
    """
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    site = str(site).strip()
    if not site or site in (".", "..") or any(c in site for c in "/\\ \t\n") or site.startswith("-"):
        raise ValueError(f"--site {site!r} is not allowed: give a plain name (letters, digits, '-', '_', '.'), the "
                         "folder its key pair is written to")
    folder = Path(out) / site
    for file in (NODE_KEY, NODE_PUB):
        if (folder / file).exists():
            _write(folder / file, b"", secret=True)
    key = ec.generate_private_key(ec.SECP384R1())
    private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                serialization.NoEncryption())
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    _write(folder / NODE_KEY, private, secret=True)
    _write(folder / NODE_PUB, public + f" {site}\n".encode(), secret=False)
    return [folder / NODE_KEY, folder / NODE_PUB]
