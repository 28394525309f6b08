"""The job's etcd certificates: a CA made for this job only, one certificate for the etcd
members (server and peer: both TLS roles) and one for the controller replicas (client).

Every file is written 0600 into the run's keys directory, once per job (a resumed job
keeps its own). etcd runs with --client-cert-auth and --peer-client-cert-auth against this
CA: nothing without a certificate of this job's CA reaches the journal.

The CA's private key lives only as long as something must sign with it. On one host the
members share the member certificate made with the set, and the key is never written.
Under Slurm each member signs its own certificate on its host (its addresses are known
there): the key is written for them, and `forget_ca_key` removes it once every member
holds its certificate, so a node process (the same user, the same shared file system)
finds no key to mint certificates with afterwards. Such a set is made afresh for each
start of the members (a requeued job's members sign again under a new CA).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALID_DAYS = 30  # a job's lifetime, with room for requeues


@dataclass(frozen=True)
class EtcdCerts:
    """Paths of one job's certificates (PEM)."""

    ca: Path
    member_cert: Path
    member_key: Path
    client_cert: Path
    client_key: Path

    @staticmethod
    def at(directory: Path) -> EtcdCerts:
        d = directory / "etcd"
        return EtcdCerts(d / "ca.crt", d / "member.crt", d / "member.key", d / "client.crt", d / "client.key")

    @property
    def ca_key(self) -> Path:
        return self.ca.with_name("ca.key")

    def for_member(self, name: str) -> EtcdCerts:
        """The same set with a member certificate of its own (`member_cert_for`)."""
        d = self.ca.parent
        return EtcdCerts(self.ca, d / f"member-{name}.crt", d / f"member-{name}.key", self.client_cert, self.client_key)

    def exist(self) -> bool:
        return all(p.exists() for p in (self.ca, self.member_cert, self.member_key, self.client_cert, self.client_key))


def _write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _name(cn: str) -> x509.Name:
    return x509.Name(
        [x509.NameAttribute(NameOID.ORGANIZATION_NAME, "resild"), x509.NameAttribute(NameOID.COMMON_NAME, cn)]
    )


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def make_certs(keys_dir: Path, hosts: Iterable[str] = (), *, members_sign: bool = False) -> EtcdCerts:
    """The job's CA and certificates, made once (an existing set is kept). `hosts`: names
    or addresses the members are reached at besides loopback. `members_sign` (Slurm):
    a new set whose CA key stays on disk for the members until `forget_ca_key`."""
    certs = EtcdCerts.at(keys_dir)
    if certs.exist() and not members_sign:
        certs.ca_key.unlink(missing_ok=True)  # a set from before the key was forgotten
        return certs
    certs.ca.parent.mkdir(parents=True, exist_ok=True)
    os.chmod(certs.ca.parent, 0o700)
    for stale in certs.ca.parent.glob("member-*"):  # signed under a CA this set replaces
        stale.unlink()
    now = datetime.datetime.now(datetime.UTC)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=VALID_DAYS)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name("resild job etcd CA")
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
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )  # key_cert_sign, crl_sign
        .sign(ca_key, hashes.SHA256())
    )
    m_cert, m_key = _leaf(ca, ca_key, "resild etcd member", MEMBER_USAGES, _sans(hosts), end)
    c_cert, c_key = _leaf(ca, ca_key, "resild controller", [ExtendedKeyUsageOID.CLIENT_AUTH], None, end)
    if members_sign:
        _write(certs.ca_key, _key_pem(ca_key))  # each member signs its own on its host
    else:
        certs.ca_key.unlink(missing_ok=True)
    _write(certs.member_cert, m_cert)
    _write(certs.member_key, m_key)
    _write(certs.client_cert, c_cert)
    _write(certs.client_key, c_key)
    _write(certs.ca, ca.public_bytes(serialization.Encoding.PEM))  # last: its presence says the set is whole
    return certs


# Members serve clients and peers and dial peers (and etcd's own gateway dials its gRPC
# server with the member's certificate): both roles.
MEMBER_USAGES = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]


def _sans(hosts: Iterable[str]) -> list[x509.GeneralName]:
    sans: list[x509.GeneralName] = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    for h in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            sans.append(x509.DNSName(h))
    return sans


def _leaf(
    ca: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    cn: str,
    usages: list[x509.ObjectIdentifier],
    sans: list[x509.GeneralName] | None,
    end: datetime.datetime,
) -> tuple[bytes, bytes]:
    key = ec.generate_private_key(ec.SECP256R1())
    b = (
        x509.CertificateBuilder()
        .subject_name(_name(cn))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(datetime.datetime.now(datetime.UTC) - datetime.timedelta(minutes=5))
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    )
    if sans is not None:
        b = b.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    cert = b.sign(ca_key, hashes.SHA256())
    return cert.public_bytes(serialization.Encoding.PEM), _key_pem(key)


def member_cert_for(keys_dir: Path, name: str, hosts: Iterable[str]) -> EtcdCerts:
    """A member certificate for the names and addresses this member is reached at (made
    on the member's own host, signed by the job's CA), in a set like `make_certs`'.
    ValueError when the CA key is gone (forgotten: the members' start is over)."""
    certs = EtcdCerts.at(keys_dir)
    ca = x509.load_pem_x509_certificate(certs.ca.read_bytes())
    try:
        pem = certs.ca_key.read_bytes()
    except FileNotFoundError:
        raise ValueError(f"{certs.ca_key}: the job's CA key is gone (its members were all certified)") from None
    ca_key = serialization.load_pem_private_key(pem, None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise ValueError(f"{certs.ca_key}: not the job's CA key")
    mine = certs.for_member(name)
    cert, key = _leaf(ca, ca_key, f"resild etcd member {name}", MEMBER_USAGES, _sans(hosts), ca.not_valid_after_utc)
    _write(mine.member_key, key)
    _write(mine.member_cert, cert)
    return mine


def forget_ca_key(keys_dir: Path) -> None:
    """Remove the CA's private key (its bytes overwritten first, for what a file system
    that writes in place keeps): no certificate of this job can be made after this."""
    path = EtcdCerts.at(keys_dir).ca_key
    try:
        fd = os.open(path, os.O_WRONLY)
    except FileNotFoundError:
        return
    try:
        os.write(fd, b"\0" * os.fstat(fd).st_size)
        os.fsync(fd)
    finally:
        os.close(fd)
    path.unlink(missing_ok=True)
