"""HTTPS for the gateway: the operator's certificate, or one made here once and kept.

`--tls self-signed` makes an ECDSA key and a certificate for this machine's names and
addresses the first time, in `$OMLX_CLUSTER_HOME/gateway-tls/` (the key 0600), and uses the same
pair at every start, so a client that pinned its SHA-256 fingerprint keeps trusting it. Nothing
here is the cluster secret's CA (omlx_shared/cluster_tls.py): API clients never see that one.
"""

from __future__ import annotations

import datetime
import ipaddress
import socket
import ssl
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from omlx_shared.private_files import write_private

DIR_NAME = "gateway-tls"
VALID_DAYS = 3650  # a pinned certificate is replaced by hand, not by expiry


class GatewayTLSError(ValueError):
    """A certificate or key that cannot be served; the message says which and why."""


@dataclass(frozen=True)
class ServingCert:
    cert: Path
    key: Path
    fingerprint: str  # SHA-256 of the certificate, hex with colons (as browsers show it)


def fingerprint_of(cert_pem: bytes) -> str:
    digest = x509.load_pem_x509_certificate(cert_pem).fingerprint(hashes.SHA256())
    return ":".join(f"{b:02X}" for b in digest)


def checked(cert: Path, key: Path) -> ServingCert:
    """The operator's pair, loaded once as the server will load it: a wrong path, a key that
    is not the certificate's or a file that is not PEM is an error now, not a traceback."""
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cert, key)
        pem = cert.read_bytes()
        return ServingCert(cert, key, fingerprint_of(pem))
    except FileNotFoundError as e:
        raise GatewayTLSError(f"{e.filename}: no such file") from None
    except (ssl.SSLError, ValueError) as e:
        raise GatewayTLSError(f"--tls-cert {cert} with --tls-key {key} cannot be served: {e} "
                              "(both PEM, the key the certificate's)") from None


def self_signed(home: Path, host: str) -> ServingCert:
    """The kept self-signed pair, made now if there is none (for `host` and this machine's
    names and addresses)."""
    folder = home / DIR_NAME
    cert, key = folder / "cert.pem", folder / "key.pem"
    if cert.exists() and key.exists():
        return checked(cert, key)
    private = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    name = socket.gethostname()
    certificate = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .public_key(private.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
        .add_extension(x509.SubjectAlternativeName(_names(host, name)), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]),
                       critical=False)
        .sign(private, hashes.SHA256()))
    write_private(key, private.private_bytes(serialization.Encoding.PEM,
                                             serialization.PrivateFormat.PKCS8,
                                             serialization.NoEncryption()))
    write_private(cert, certificate.public_bytes(serialization.Encoding.PEM))
    return checked(cert, key)


def _names(host: str, hostname: str) -> list[x509.GeneralName]:
    """localhost, loopback, the host name (and its .local Bonjour name), and `host` when it
    is a specific address or name."""
    dns = {"localhost", hostname, hostname.split(".")[0] + ".local"}
    ips = {"127.0.0.1", "::1"}
    if host not in ("0.0.0.0", "::", ""):
        try:
            ips.add(str(ipaddress.ip_address(host)))
        except ValueError:
            dns.add(host)
    return ([x509.DNSName(d) for d in sorted(dns)]
            + [x509.IPAddress(ipaddress.ip_address(i)) for i in sorted(ips)])
