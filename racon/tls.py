"""The controller's own certificate authority, its server certificate, and the pin of the join line.

`BIND=<LAN address> make run` serves HTTPS on the LAN and TLS Redis with certificates from a CA
the controller creates on its first LAN start and keeps in the var directory (docs/design/
serving.md, "LAN and trust"):

    <var>/tls/ca.key       the CA's private key (0600; it never leaves the var directory)
    <var>/tls/ca.crt       the CA certificate: what agents keep and verify every https and
                           rediss connection against
    <var>/tls/server.key   the controller's server key (0600): HTTPS and the LAN Redis
    <var>/tls/server.crt   its certificate, issued by the CA for the LAN address and loopback

The join line pins the server key (`curl --pinnedpubkey sha256//…` checks the leaf's public
key). Renewing a certificate keeps its key, so a pin stays valid for as long as the key lives;
only `manage.py racon_tls rotate` makes new keys. Pure file and crypto work: no Django, so the
launcher, management commands and other modules (the RPC tunnel's per-deployment certificates)
share it.

Public API (kept stable; other modules build on it):
    ca_load_or_create(var_dir=, now=)          -> (CA, message or None)
    issue_leaf(ca, common_name=, ips=, dns=, key=, days=, server=, client=, now=) -> Leaf
    server_cert_ensure(var_dir=, ca=, ips=, dns=, now=) -> (ServerCert, message or None)
    spki_pin(cert_or_key_or_pem)               -> "sha256//<base64>"
    rotate(var_dir=, ca_too=, now=)            -> list of what was replaced
    write_private(path, data)                  a 0600 file, never readable by others
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CA_DAYS = 3650
SERVER_DAYS = 397
# A certificate is renewed (same key) when less than this is left of it.
RENEW_BEFORE = dt.timedelta(days=30)
CA_NAME = "RACoN controller CA"

PrivateKey = ec.EllipticCurvePrivateKey


class TlsError(RuntimeError):
    """A certificate or key file is unusable; the message names the file and the fix."""


@dataclass(frozen=True)
class CA:
    cert: x509.Certificate
    key: PrivateKey
    cert_path: Path
    key_path: Path

    def pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)


@dataclass(frozen=True)
class Leaf:
    cert: x509.Certificate
    key: PrivateKey

    @property
    def cert_pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    @property
    def key_pem(self) -> bytes:
        return key_pem(self.key)

    @property
    def pin(self) -> str:
        return spki_pin(self.cert)


@dataclass(frozen=True)
class ServerCert:
    cert_path: Path
    key_path: Path
    ca_path: Path
    pin: str
    not_after: dt.datetime


def tls_dir(var_dir: Path) -> Path:
    return Path(var_dir) / "tls"


def _now(now: dt.datetime | None) -> dt.datetime:
    return now or dt.datetime.now(dt.UTC)


def new_key() -> PrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def key_pem(key: PrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def write_private(path: Path, data: bytes) -> None:
    """Write a file created 0600 from the start, atomically (no window where others can read)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def _write_public(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    tmp.chmod(0o644)
    os.replace(tmp, path)


def _load_key(path: Path) -> PrivateKey:
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except (OSError, ValueError) as exc:
        raise TlsError(
            f"cannot read the private key {path} ({exc}); restore it from a backup, or make new "
            "keys with `manage.py racon_tls rotate --ca` (every joined agent must then re-pin)"
        ) from exc
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise TlsError(f"{path} is not an EC private key")
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        path.chmod(0o600)  # a key others could read is made private again, never left so
    return key


def _load_cert(path: Path) -> x509.Certificate | None:
    try:
        return x509.load_pem_x509_certificate(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return None  # unreadable: issued again from the key


def _expired_soon(cert: x509.Certificate, now: dt.datetime) -> bool:
    return cert.not_valid_after_utc - now < RENEW_BEFORE


def _ca_cert(key: PrivateKey, now: dt.datetime) -> x509.Certificate:
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, CA_NAME)])
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    return (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
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
        )  # fmt: skip
        .add_extension(ski, critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski), critical=False
        )
        .sign(key, hashes.SHA256())
    )


def ca_load_or_create(*, var_dir: Path, now: dt.datetime | None = None) -> tuple[CA, str | None]:
    """The CA in var_dir/tls, created on first use. A CA certificate that expired (or expires
    within RENEW_BEFORE) is renewed with the same key. The message says what was done (None when
    nothing was)."""
    now = _now(now)
    d = tls_dir(var_dir)
    key_path, cert_path = d / "ca.key", d / "ca.crt"
    message = None
    if key_path.exists():
        key = _load_key(key_path)
        cert = _load_cert(cert_path)
        if cert is None or cert.public_key() != key.public_key() or _expired_soon(cert, now):
            old = cert.not_valid_after_utc if cert is not None else None
            cert = _ca_cert(key, now)
            _write_public(cert_path, cert.public_bytes(serialization.Encoding.PEM))
            message = (
                f"renewed the controller's CA certificate {cert_path} with the same key"
                + (f" (the old one ended {old:%Y-%m-%d})" if old else "")
                + f"; valid until {cert.not_valid_after_utc:%Y-%m-%d}. Agents that keep the old "
                "CA certificate re-pin by running a new join line on their machine"
            )
    else:
        d.mkdir(parents=True, exist_ok=True)
        d.chmod(0o700)
        key = new_key()
        write_private(key_path, key_pem(key))
        cert = _ca_cert(key, now)
        _write_public(cert_path, cert.public_bytes(serialization.Encoding.PEM))
        message = f"created the controller's CA in {d} (private key {key_path}, mode 0600)"
    return CA(cert=cert, key=key, cert_path=cert_path, key_path=key_path), message


def _san(ips: Sequence[str], dns: Sequence[str]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = [x509.DNSName(n) for n in dns]
    names += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]
    return x509.SubjectAlternativeName(names)


def issue_leaf(
    ca: CA,
    *,
    common_name: str,
    ips: Sequence[str] = (),
    dns: Sequence[str] = (),
    key: PrivateKey | None = None,
    days: int = SERVER_DAYS,
    server: bool = True,
    client: bool = False,
    now: dt.datetime | None = None,
) -> Leaf:
    """A certificate the CA signs for `common_name` with these IP and DNS names (subject
    alternative names; a verifier checks the address it connected to against them). `key`:
    keep an existing key (a renewal); else a new one. `server`/`client`: the extended key usages."""
    now = _now(now)
    key = key or new_key()
    usages = [ExtendedKeyUsageOID.SERVER_AUTH] if server else []
    usages += [ExtendedKeyUsageOID.CLIENT_AUTH] if client else []
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name[:64])]))
        .issuer_name(ca.cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(min(now + dt.timedelta(days=days), ca.cert.not_valid_after_utc))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=True,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )  # fmt: skip
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.key.public_key()), critical=False
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
    )
    if usages:
        builder = builder.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    if ips or dns:
        builder = builder.add_extension(_san(ips, dns), critical=False)
    return Leaf(cert=builder.sign(ca.key, hashes.SHA256()), key=key)


def _names_of(cert: x509.Certificate) -> tuple[set[str], set[str]]:
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return set(), set()
    ips = {str(ip) for ip in san.get_values_for_type(x509.IPAddress)}
    return ips, set(san.get_values_for_type(x509.DNSName))


def server_cert_ensure(
    *,
    var_dir: Path,
    ca: CA,
    ips: Sequence[str],
    dns: Sequence[str] = ("localhost",),
    now: dt.datetime | None = None,
) -> tuple[ServerCert, str | None]:
    """The controller's server certificate for these addresses (HTTPS and the LAN Redis).

    The key is made once and kept: a certificate that is missing, near its end, issued by
    another CA or lacking one of the addresses is issued again for the same key, so the pin in
    every join line already given out stays valid."""
    now = _now(now)
    d = tls_dir(var_dir)
    key_path, cert_path = d / "server.key", d / "server.crt"
    message = None
    if key_path.exists():
        key = _load_key(key_path)
    else:
        key = new_key()
        write_private(key_path, key_pem(key))
        message = f"created the controller's server key {key_path} (mode 0600)"
    cert = _load_cert(cert_path)
    want_ips = {str(ipaddress.ip_address(ip)) for ip in ips}
    reason = None
    if cert is None:
        reason = "issued"
    elif cert.public_key() != key.public_key():
        reason = "issued again (it did not match the key)"
    elif cert.issuer != ca.cert.subject or _signed_by_other(cert, ca):
        reason = "issued again (the CA changed)"
    elif _expired_soon(cert, now):
        reason = f"renewed with the same key (it ended {cert.not_valid_after_utc:%Y-%m-%d})"
    elif not want_ips <= _names_of(cert)[0]:
        reason = "issued again for " + ", ".join(sorted(want_ips))
    if reason:
        ips_all = sorted(want_ips | (_names_of(cert)[0] if cert is not None else set()))
        leaf = issue_leaf(
            ca, common_name="racon-controller", ips=ips_all, dns=dns, key=key, now=now
        )
        cert = leaf.cert
        _write_public(cert_path, leaf.cert_pem)
        if reason != "issued" or message is None:
            message = f"server certificate {cert_path} {reason}; the join pin is unchanged"
    assert cert is not None
    return (
        ServerCert(
            cert_path=cert_path,
            key_path=key_path,
            ca_path=ca.cert_path,
            pin=spki_pin(cert),
            not_after=cert.not_valid_after_utc,
        ),
        message,
    )


def _signed_by_other(cert: x509.Certificate, ca: CA) -> bool:
    try:
        cert.verify_directly_issued_by(ca.cert)
    except (ValueError, TypeError, Exception):  # InvalidSignature and friends
        return True
    return False


def spki_pin(obj: x509.Certificate | ec.EllipticCurvePublicKey | PrivateKey | bytes | Path) -> str:
    """`sha256//<base64 of the SHA-256 of the DER SubjectPublicKeyInfo>`: the form curl's
    --pinnedpubkey takes, of a certificate, a key, or a PEM certificate (bytes or a path)."""
    if isinstance(obj, Path):
        obj = obj.read_bytes()
    if isinstance(obj, bytes):
        obj = x509.load_pem_x509_certificate(obj)
    if isinstance(obj, x509.Certificate):
        public = obj.public_key()
    elif isinstance(obj, ec.EllipticCurvePrivateKey):
        public = obj.public_key()
    else:
        public = obj
    der = public.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return "sha256//" + base64.b64encode(hashlib.sha256(der).digest()).decode()


def rotate(*, var_dir: Path, ca_too: bool = False, now: dt.datetime | None = None) -> list[str]:
    """New keys: the server key (a new join pin), and with ca_too the CA's as well. What was
    replaced is returned as lines for the operator. The old files are kept as *.old."""
    d = tls_dir(var_dir)
    names = ["server.key", "server.crt"] + (["ca.key", "ca.crt"] if ca_too else [])
    done = []
    for name in names:
        path = d / name
        if path.exists():
            old = path.with_name(name + ".old")
            os.replace(path, old)
            if name.endswith(".key"):
                old.chmod(0o600)
            done.append(f"{path} -> {old}")
    return done
