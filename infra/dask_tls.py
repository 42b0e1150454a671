"""Dask with TLS and mutual authentication for the stack and the embedded default.

Without it, any local user (and any process that can reach loopback) connects a plain
`Client` to the scheduler and runs code on every worker with `client.run`, where the workers
hold the stack's S3 and Lambda keys. With it, every Dask listener (scheduler, workers, nannies)
speaks TLS 1.2+ and requires a certificate signed by a CA that exists only for this stack:

- `ensure_certs(dir)` makes, in a private directory (0700, files 0600), a fresh CA and one
  leaf certificate + key signed by it (all roles share the leaf: Dask checks only that the
  peer's certificate chains to the CA). The CA's private key is never written anywhere, so no
  further certificate can be issued, and reading the CA certificate alone does not let anyone in;
- `security(dir)` is the matching `distributed.security.Security` (require_encryption=True);
- `dask_config(dir)` is the same as Dask config, so `Client(address)`, Prefect's
  `DaskTaskRunner` and `dask worker` processes pick it up without being handed the object.

The stack keeps its certificates in `<state dir>/dask-tls/`; the embedded default makes a fresh
set per run in a private temporary directory that goes away with the run.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dask
from distributed.security import Security

from infra.dask_cluster import WORKER_ENVIRON
from infra.state import private_dir, write_private

CA, CERT, KEY = "ca.pem", "cert.pem", "key.pem"
VALID_DAYS = 365


def _name(cn: str) -> Any:
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _generate() -> tuple[bytes, bytes, bytes]:
    """(CA certificate, leaf certificate, leaf key) as PEM. EC P-256: key generation and
    handshakes are cheaper than RSA, which matters for the many short Dask connections."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID

    now = dt.datetime.now(dt.timezone.utc)
    start, end = now - dt.timedelta(minutes=5), now + dt.timedelta(days=VALID_DAYS)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name("rollart-stack-ca")
    ca_ski = x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key())
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(start).not_valid_after(end)
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False,
                                       key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, key_cert_sign=True, crl_sign=True,
                                       encipher_only=False, decipher_only=False), critical=True)
          .add_extension(ca_ski, critical=False)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    leaf = (x509.CertificateBuilder().subject_name(_name("rollart-dask"))
            .issuer_name(ca_name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.DNSName("dask-internal")]),
                           critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(
                ca_ski), critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    key_pem = key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    return ca.public_bytes(pem), leaf.public_bytes(pem), key_pem


def _valid(d: Path) -> bool:
    from cryptography import x509

    try:
        cert = x509.load_pem_x509_certificate((d / CERT).read_bytes())
        (d / KEY).stat()
        (d / CA).stat()
    except (OSError, ValueError):
        return False
    # renew a day early rather than fail a run that starts just before expiry
    return cert.not_valid_after_utc > dt.datetime.now(dt.timezone.utc) + dt.timedelta(days=1)


def ensure_certs(directory: Path | str) -> Path:
    """The stack's CA + leaf in `directory` (created 0700; files 0600), made once and reused."""
    d = private_dir(Path(directory).absolute())
    if not _valid(d):
        ca, cert, key = _generate()
        write_private(d / KEY, key)  # key first: a cert without its key is never "valid"
        write_private(d / CERT, cert)
        write_private(d / CA, ca)
    return d


def has_certs(directory: Path | str) -> bool:
    return _valid(Path(directory))


def security(directory: Path | str) -> Security:
    d = Path(directory)
    files = {"tls_ca_file": str(d / CA)}
    for role in ("client", "scheduler", "worker"):
        files[f"tls_{role}_cert"] = str(d / CERT)
        files[f"tls_{role}_key"] = str(d / KEY)
    return Security(require_encryption=True, **files)


def dask_config(directory: Path | str) -> dict[str, Any]:
    """Dask config (nested) for TLS with these certificates; `distributed.comm.tls.*`."""
    d = Path(directory)
    pair = {"cert": str(d / CERT), "key": str(d / KEY)}
    return {"distributed": {"comm": {
        "require-encryption": True,
        "default-scheme": "tls",
        "tls": {"ca-file": str(d / CA), "client": dict(pair), "scheduler": dict(pair),
                "worker": dict(pair)},
    }}}


def configured() -> bool:
    """True when this process's Dask config already names TLS certificates (the user's own
    cluster settings, or ours): then we leave them alone."""
    return bool(dask.config.get("distributed.comm.tls.ca-file", None))


@contextlib.contextmanager
def temporary_certs() -> Iterator[Path]:
    """A fresh CA + leaf in a private temporary directory (mkdtemp: 0700), removed on exit."""
    d = Path(tempfile.mkdtemp(prefix="rollart-dask-tls-"))
    try:
        yield ensure_certs(d)
    finally:
        shutil.rmtree(d, ignore_errors=True)


@contextlib.contextmanager
def tls_config(directory: Path | str) -> Iterator[None]:
    """This process's Dask config uses `directory`'s certificates for the block's duration."""
    with dask.config.set(flat(dask_config(directory))):
        yield


def flat(cfg: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Dotted keys: `dask.config.set` replaces a whole subtree when handed a nested dict."""
    out: dict[str, Any] = {}
    for k, v in cfg.items():
        if isinstance(v, dict):
            out.update(flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def stack_cert_dir(state_dir: Path | str | None = None) -> Path:
    return Path(state_dir or os.environ.get("ROLLART_STATE_DIR", ".rollart")) / "dask-tls"


def embedded(stack: contextlib.ExitStack, enabled: bool = True) -> Security | None:
    """Security for an embedded cluster that lives as long as `stack`: fresh certificates for
    this run and this process's Dask config pointing at them (so `Client(address)` and the
    DaskTaskRunner use them). None when `enabled` is false (`cluster.tls: false`)."""
    if not enabled:
        return None
    d = stack.enter_context(temporary_certs())
    stack.enter_context(tls_config(d))
    return security(d)


def connect_existing(stack: contextlib.ExitStack, address: str,
                     state_dir: Path | str | None = None) -> bool:
    """A `tls://` address with no TLS in this process's Dask config: use the local stack's
    certificates when it has them (`rollart up`'s cluster). A user's own cluster keeps its own
    settings (Dask config or DASK_DISTRIBUTED__COMM__TLS__* variables). True when applied."""
    if not address.startswith("tls://") or configured():
        return False
    d = stack_cert_dir(state_dir)
    if not has_certs(d):
        return False
    stack.enter_context(tls_config(d))
    return True


def stack_dask_config_dir(state: Path) -> Path:
    """DASK_CONFIG of the stack's `dask scheduler` / `dask worker` processes: TLS with the
    stack's certificates (made here on first use), and the workers' malloc settings in place of
    the nanny's MALLOC_TRIM_THRESHOLD_ (WORKER_ENVIRON, see infra/dask_cluster.py)."""
    certs = ensure_certs(stack_cert_dir(state))
    d = private_dir(Path(state) / "dask-config")
    environ = {k: (None if v is None else str(v)) for k, v in WORKER_ENVIRON.items()}
    cfg = dask_config(certs)
    cfg["distributed"]["nanny"] = {"pre-spawn-environ": environ}
    write_private(d / "rollart.yaml", json.dumps(cfg, indent=2))  # JSON is YAML
    return d


__all__ = ["configured", "connect_existing", "dask_config", "embedded", "ensure_certs",
           "has_certs", "security", "stack_cert_dir", "stack_dask_config_dir", "temporary_certs",
           "tls_config"]
