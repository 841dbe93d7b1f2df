"""`BIND=<address> make run`'s pure parts (issue 24): the address, unsafe Redis URLs, the CA."""

from __future__ import annotations

import datetime as dt
import os
from pathlib import Path

import pytest
from cryptography import x509

from racon import tls
from racon.lan import BindError, redis_url_problem, resolve_bind

ADDRS = ["127.0.0.1", "192.168.1.10", "10.0.0.7", "169.254.3.4", "8.8.4.4", "::1", "fe80::1"]


def test_loopback_is_no_lan() -> None:
    assert resolve_bind("127.0.0.1", ADDRS) == (None, "")
    assert resolve_bind("localhost", ADDRS) == (None, "")


def test_any_picks_the_private_address_and_says_which() -> None:
    address, said = resolve_bind("0.0.0.0", ADDRS)
    assert address == "192.168.1.10"  # the first private one
    assert "10.0.0.7" in said and "192.168.1.10" in said


def test_an_address_the_machine_lacks_names_its_addresses() -> None:
    with pytest.raises(BindError) as exc:
        resolve_bind("192.168.9.9", ADDRS)
    assert "not an address of this machine" in str(exc.value) and "192.168.1.10" in str(exc.value)


@pytest.mark.parametrize(("bind", "why"), [("8.8.4.4", "public"), ("169.254.3.4", "link-local")])
def test_a_public_or_link_local_address_is_refused_naming_why(bind: str, why: str) -> None:
    with pytest.raises(BindError) as exc:
        resolve_bind(bind, ADDRS)
    assert why in str(exc.value) and "private networks" in str(exc.value)


def test_a_loopback_redis_is_left_alone() -> None:
    assert redis_url_problem("redis://127.0.0.1:6379/0", name="REDIS_URL") is None
    assert redis_url_problem("redis://localhost:6379/0", name="REDIS_URL") is None


def test_a_lan_redis_without_tls_is_refused_naming_the_fix() -> None:
    said = redis_url_problem("redis://:pw@192.168.1.10:6379/0", name="RACON_AGENT_REDIS_URL")
    assert said is not None and "without TLS" in said and "rediss://" in said
    assert "pw" not in said  # the password is redacted


def test_the_ca_is_private_and_renewals_keep_the_pin(tmp_path: Path) -> None:
    ca, said = tls.ca_load_or_create(var_dir=tmp_path)
    assert said and "created" in said
    cert, _ = tls.server_cert_ensure(var_dir=tmp_path, ca=ca, ips=["10.0.0.7", "127.0.0.1"])
    for key in ("ca.key", "server.key"):
        assert os.stat(tmp_path / "tls" / key).st_mode & 0o777 == 0o600
    # Ten years on: the CA certificate has expired; it is renewed with the same key, and says so.
    later = dt.datetime.now(dt.UTC) + dt.timedelta(days=tls.CA_DAYS + 1)
    ca2, said = tls.ca_load_or_create(var_dir=tmp_path, now=later)
    assert said and "renewed" in said and "same key" in said
    assert tls.spki_pin(ca2.cert) == tls.spki_pin(ca.cert)
    cert2, said = tls.server_cert_ensure(var_dir=tmp_path, ca=ca2, ips=["10.0.0.7"], now=later)
    assert cert2.pin == cert.pin and said and "pin is unchanged" in said
    leaf = x509.load_pem_x509_certificate(cert2.cert_path.read_bytes())
    leaf.verify_directly_issued_by(ca2.cert)
    # A rotation is explicit: new keys, a new pin.
    assert tls.rotate(var_dir=tmp_path)
    cert3, _ = tls.server_cert_ensure(var_dir=tmp_path, ca=ca2, ips=["10.0.0.7"], now=later)
    assert cert3.pin != cert.pin


def test_issued_leaves_verify_against_the_ca(tmp_path: Path) -> None:
    import ssl

    ca, _ = tls.ca_load_or_create(var_dir=tmp_path)
    leaf = tls.issue_leaf(ca, common_name="deployment-x", ips=["10.0.0.9"], client=True)
    (tmp_path / "leaf.pem").write_bytes(leaf.cert_pem + leaf.key_pem)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(tmp_path / "leaf.pem")  # key and certificate match
    assert leaf.pin.startswith("sha256//")
    leaf.cert.verify_directly_issued_by(ca.cert)
