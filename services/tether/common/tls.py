"""TLS between Tether's services: certificates from files, read once when a server or channel is made.

    TETHER_TLS_CERT_FILE    this service's certificate (PEM; a chain: leaf first)
    TETHER_TLS_KEY_FILE     its private key (PEM)
    TETHER_TLS_CA_FILE      the CA(s) the peers' certificates must chain to (PEM)
    TETHER_TLS_SERVER_NAME  the name clients expect in the servers' certificates (default: the host
                            of the address dialled), so one certificate can serve every service
    TETHER_GRPC_HEALTH_PORT a plaintext port that serves gRPC health only (0 = none), for probes
                            that cannot present a client certificate (kubelet's gRPC probe)

None of the first three set: plaintext (the local stack on loopback). Certificate and key: every gRPC
server serves TLS on its port, and every client (`channel()`, `tether health`, the launcher) dials
with TLS and presents the certificate. With a CA as well (mutual TLS): servers refuse a client whose
certificate does not chain to the CA (the handshake fails, the caller sees UNAVAILABLE), and clients
verify the servers against the CA instead of the system's roots. The files are read at start-up only:
a renewed certificate takes a restart (a rolling restart in Kubernetes). A named file that is missing,
unreadable, empty or not PEM stops the service at start-up with the variable's name.

It imports only grpc, so `tether health` (run every few seconds in every container) can use it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import grpc

CERT_ENV = "TETHER_TLS_CERT_FILE"
KEY_ENV = "TETHER_TLS_KEY_FILE"
CA_ENV = "TETHER_TLS_CA_FILE"
SERVER_NAME_ENV = "TETHER_TLS_SERVER_NAME"
HEALTH_PORT_ENV = "TETHER_GRPC_HEALTH_PORT"


class TlsSettingsError(RuntimeError):
    """A TLS setting that cannot be used; the message names the variable."""


@dataclass(frozen=True)
class Tls:
    """One service's TLS material (PEM bytes). `ca` None: TLS without client certificates, and the
    servers verified against the system's roots."""

    cert: bytes
    key: bytes
    ca: bytes | None = None
    server_name: str = ""

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.key, self.cert)], root_certificates=self.ca, require_client_auth=self.ca is not None
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert
        )

    def channel_options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


def _read_pem(env: Mapping[str, str], name: str) -> bytes:
    path = env[name]
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise TlsSettingsError(f"{name}={path}: cannot read it: {exc.strerror or exc}") from None
    if b"-----BEGIN " not in data:
        raise TlsSettingsError(f"{name}={path}: {'empty' if not data.strip() else 'not a PEM file'}")
    return data


def tls_from_env(environ: Mapping[str, str] | None = None) -> Tls | None:
    """The TLS the environment asks for (None: plaintext); raises TlsSettingsError naming the variable
    when a file is missing or not PEM, or when the certificate comes without its key (or the reverse)."""
    env = os.environ if environ is None else environ
    given = {name for name in (CERT_ENV, KEY_ENV, CA_ENV) if env.get(name, "").strip()}
    if not given:
        return None
    for name, other in ((CERT_ENV, KEY_ENV), (KEY_ENV, CERT_ENV)):
        if other in given and name not in given:
            raise TlsSettingsError(f"{other} is set but {name} is not: TLS needs both")
    if CA_ENV in given and CERT_ENV not in given:
        raise TlsSettingsError(f"{CA_ENV} is set but {CERT_ENV} and {KEY_ENV} are not: TLS needs both")
    stripped = {name: env[name].strip() for name in given}
    return Tls(
        cert=_read_pem(stripped, CERT_ENV),
        key=_read_pem(stripped, KEY_ENV),
        ca=_read_pem(stripped, CA_ENV) if CA_ENV in given else None,
        server_name=env.get(SERVER_NAME_ENV, "").strip(),
    )


def health_port_from_env(environ: Mapping[str, str] | None = None) -> int:
    """TETHER_GRPC_HEALTH_PORT (0 or unset: none); raises TlsSettingsError naming it if it is no port."""
    env = os.environ if environ is None else environ
    value = env.get(HEALTH_PORT_ENV, "").strip() or "0"
    if not value.isdigit() or int(value) > 65535:
        raise TlsSettingsError(f"{HEALTH_PORT_ENV}={value!r}: want a port in 1..65535 (0 = none)")
    return int(value)


def sync_channel(
    address: str, tls: Tls | None, options: list[tuple[str, object]] | None = None
) -> grpc.Channel:
    """A blocking channel (`tether health`, the launcher's health waits) with the service's TLS."""
    if tls is None:
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(
        address, tls.channel_credentials(), options=[*(options or []), *tls.channel_options()]
    )
