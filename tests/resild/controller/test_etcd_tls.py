"""The job's etcd certificates: the CA key exists only while members must sign with it."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.exceptions import InvalidSignature

from resild.controller.etcd_tls import EtcdCerts, forget_ca_key, make_certs, member_cert_for


def _signed_by(cert: Path, ca: Path) -> bool:
    leaf = x509.load_pem_x509_certificate(cert.read_bytes())
    try:
        leaf.verify_directly_issued_by(x509.load_pem_x509_certificate(ca.read_bytes()))
    except (InvalidSignature, ValueError, TypeError):
        return False
    return True


def test_one_host_set_never_writes_the_ca_key(tmp_path: Path) -> None:
    certs = make_certs(tmp_path)
    assert certs.exist() and not certs.ca_key.exists()
    assert _signed_by(certs.member_cert, certs.ca) and _signed_by(certs.client_cert, certs.ca)
    for f in certs.ca.parent.iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
    assert stat.S_IMODE(certs.ca.parent.stat().st_mode) == 0o700
    # Kept as it is on a second call (a resumed job), and a key an older tree left is removed.
    certs.ca_key.write_bytes(b"old")
    again = make_certs(tmp_path)
    assert again.ca.read_bytes() == certs.ca.read_bytes() and not certs.ca_key.exists()


def test_members_sign_their_own_then_the_key_is_forgotten(tmp_path: Path) -> None:
    old = make_certs(tmp_path).ca.read_bytes()
    certs = make_certs(tmp_path, members_sign=True)
    assert certs.ca.read_bytes() != old, "a set the members sign under is made afresh"
    assert certs.ca_key.exists() and stat.S_IMODE(certs.ca_key.stat().st_mode) == 0o600
    mine = member_cert_for(tmp_path, "m0", ["10.0.0.7", "node7"])
    assert mine.member_cert == EtcdCerts.at(tmp_path).for_member("m0").member_cert
    assert _signed_by(mine.member_cert, certs.ca)
    sans = x509.load_pem_x509_certificate(mine.member_cert.read_bytes()).extensions.get_extension_for_class(
        x509.SubjectAlternativeName
    )
    assert "node7" in sans.value.get_values_for_type(x509.DNSName)
    forget_ca_key(tmp_path)
    assert not certs.ca_key.exists()
    with pytest.raises(ValueError, match="CA key is gone"):
        member_cert_for(tmp_path, "m1", ["10.0.0.8"])
    forget_ca_key(tmp_path)  # twice: nothing to do


def test_a_new_signing_set_drops_the_member_certificates_of_the_old_ca(tmp_path: Path) -> None:
    make_certs(tmp_path, members_sign=True)
    stale = member_cert_for(tmp_path, "m0", []).member_cert
    make_certs(tmp_path, members_sign=True)
    assert not stale.exists(), "a member waiting for its certificate must not find one of the old CA"
