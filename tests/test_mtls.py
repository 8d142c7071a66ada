"""Mutual TLS between the services (tether.common.tls, tether.common.grpc_server): certificates from a
CA made here with `cryptography`, and the real servicers of two services (the gateway's GatewayControl
and the merger's status) on grpc.aio servers. A client with a certificate from the CA passes (and still
needs the service token); no certificate, one from another CA, plaintext, a server the CA did not sign
and a wrong server name all fail the handshake (UNAVAILABLE). Health stays reachable for probes on a
plaintext port that serves nothing else; `tether health` dials with the container's TLS."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tether.common import broker, health, tls
from tether.common.grpc_server import channel, start_server
from tether.common.tls import Tls, TlsSettingsError, tls_from_env
from tether.gateway.admission import Admission
from tether.gateway.servicer import GatewayControlServicer
from tether.merger.consumer import Merger, MergerConfig
from tether.merger.servicer import MergerStatusServicer
from tether.v1 import gateway_pb2, gateway_pb2_grpc, merger_pb2, merger_pb2_grpc, types_pb2

TOKEN = "mtls-test-token"
NAME = "tether-services"  # the one name in the services' certificate (TETHER_TLS_SERVER_NAME)
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE


@dataclass
class Issued:
    cert: bytes
    key: bytes


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


class CA:
    """A certificate authority made on the spot (P-256, valid for a day)."""

    def __init__(self, name: str) -> None:
        self.key = ec.generate_private_key(ec.SECP256R1())
        self.name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = datetime.datetime.now(datetime.UTC)
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(self.name)
            .issuer_name(self.name)
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(True, False, False, False, False, True, True, False, False), critical=True
            )
            .sign(self.key, hashes.SHA256())
        )
        self.pem = self.cert.public_bytes(serialization.Encoding.PEM)

    def issue(self, common_name: str, dns: list[str], ips: list[str] = ()) -> Issued:
        """A certificate for both ends of a call (serverAuth + clientAuth), as the chart's one Secret
        gives every pod."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        sans = [x509.DNSName(d) for d in dns] + [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
            .issuer_name(self.name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                critical=False,
            )
            .sign(self.key, hashes.SHA256())
        )
        return Issued(cert.public_bytes(serialization.Encoding.PEM), _pem_key(key))


@pytest.fixture(scope="module")
def pki():
    ours, theirs = CA("tether test CA"), CA("someone else's CA")
    return {
        "ca": ours.pem,
        "service": ours.issue("tether", [NAME]),
        "loopback": ours.issue("tether", ["localhost"], ["127.0.0.1"]),
        "stranger": theirs.issue("tether", [NAME]),  # right name, wrong CA
    }


def _tls(pki, which: str = "service", server_name: str = NAME) -> Tls:
    return Tls(pki[which].cert, pki[which].key, pki["ca"], server_name)


def _register(server: grpc.aio.Server) -> list[str]:
    gateway_pb2_grpc.add_GatewayControlServicer_to_server(GatewayControlServicer(Admission(7)), server)
    merger = Merger(None, broker.Keys("mtls"), MergerConfig(), None)
    merger_pb2_grpc.add_MergerServicer_to_server(MergerStatusServicer(merger), server)
    return [
        gateway_pb2.DESCRIPTOR.services_by_name["GatewayControl"].full_name,
        merger_pb2.DESCRIPTOR.services_by_name["Merger"].full_name,
    ]


async def _calls(ch: grpc.aio.Channel) -> dict[str, object]:
    """GatewayControl.GetAdmission and Merger.GetStatus: the answer, or the status code."""
    out: dict[str, object] = {}
    calls = {
        "gateway": lambda: gateway_pb2_grpc.GatewayControlStub(ch).GetAdmission(types_pb2.Empty(), timeout=5),
        "merger": lambda: merger_pb2_grpc.MergerStub(ch).GetStatus(types_pb2.Empty(), timeout=5),
    }
    for name, call in calls.items():
        try:
            reply = await call()
            out[name] = reply.weight_version if name == "gateway" else reply.groups_emitted
        except grpc.aio.AioRpcError as exc:
            out[name] = exc.code()
    return out


def _against(server_tls: Tls, dial) -> dict[str, object]:
    """Start a server with `server_tls` and the token; `dial(port)` makes the client's channel."""

    async def main() -> dict[str, object]:
        server, health_handle, port = await start_server(
            0, _register, token=TOKEN, tls=server_tls, health_port=0
        )
        await health_handle.set(True)
        try:
            async with dial(port) as ch:
                return await _calls(ch)
        finally:
            await server.stop(0)

    return asyncio.run(main())


def _ours(pki, **kw):
    def dial(port: int) -> grpc.aio.Channel:
        args = {"tls": _tls(pki), "token": TOKEN, **kw}
        return channel(f"127.0.0.1:{port}", wait_for_ready=False, **args)

    return dial


def test_a_client_with_the_cas_certificate_and_the_token_passes(pki):
    assert _against(_tls(pki), _ours(pki)) == {"gateway": 7, "merger": 0}


def test_the_service_token_is_still_checked_over_mtls(pki):
    out = _against(_tls(pki), _ours(pki, token=""))
    assert out == {"gateway": grpc.StatusCode.UNAUTHENTICATED, "merger": grpc.StatusCode.UNAUTHENTICATED}


def test_a_client_without_a_certificate_is_refused(pki):
    def dial(port: int) -> grpc.aio.Channel:
        creds = grpc.ssl_channel_credentials(root_certificates=pki["ca"])  # verifies the server, no cert
        return grpc.aio.secure_channel(
            f"127.0.0.1:{port}", creds, options=[("grpc.ssl_target_name_override", NAME)]
        )

    assert _against(_tls(pki), dial) == {"gateway": UNAVAILABLE, "merger": UNAVAILABLE}


def test_a_certificate_from_another_ca_is_refused(pki):
    assert _against(_tls(pki), _ours(pki, tls=_tls(pki, "stranger"))) == {
        "gateway": UNAVAILABLE,
        "merger": UNAVAILABLE,
    }


def test_a_server_the_ca_did_not_sign_is_refused_by_the_client(pki):
    assert _against(_tls(pki, "stranger"), _ours(pki)) == {"gateway": UNAVAILABLE, "merger": UNAVAILABLE}


def test_plaintext_is_refused(pki):
    assert _against(_tls(pki), _ours(pki, tls=None)) == {"gateway": UNAVAILABLE, "merger": UNAVAILABLE}


def test_a_wrong_server_name_is_refused(pki):
    # The certificate names NAME only: the client dialling 127.0.0.1 (no override), or expecting
    # another name, must not accept it.
    for name in ("", "trainer.example"):
        out = _against(_tls(pki), _ours(pki, tls=_tls(pki, server_name=name)))
        assert out == {"gateway": UNAVAILABLE, "merger": UNAVAILABLE}, name


def test_health_for_probes_on_a_plaintext_port_that_serves_nothing_else(pki, tmp_path, monkeypatch):
    """TETHER_GRPC_HEALTH_PORT: kubelet's gRPC probe (no TLS) reads health there and can reach nothing
    else; the service's own port keeps refusing plaintext; `tether health` with the container's TLS
    settings checks the mTLS port itself."""
    from tether.common.net import free_port

    files = _write(tmp_path, pki, "loopback")  # a certificate for 127.0.0.1: no server name needed
    for var, path in files.items():
        monkeypatch.setenv(var, path)
    probe_port = free_port()
    monkeypatch.setenv(tls.HEALTH_PORT_ENV, str(probe_port))
    monkeypatch.setenv("TETHER_SERVICE_TOKEN", TOKEN)

    async def main() -> dict[str, object]:
        server, health_handle, port = await start_server(0, _register)  # all from the environment
        await health_handle.set(True)
        out: dict[str, object] = {}
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{probe_port}") as plain:
                reply = await health_pb2_grpc.HealthStub(plain).Check(
                    health_pb2.HealthCheckRequest(), timeout=5
                )
                out["probe health"] = reply.status
                out["probe other"] = (await _calls(plain))["gateway"]
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as plain:
                try:
                    await health_pb2_grpc.HealthStub(plain).Check(health_pb2.HealthCheckRequest(), timeout=5)
                    out["main plaintext health"] = "answered"
                except grpc.aio.AioRpcError as exc:
                    out["main plaintext health"] = exc.code()
            async with channel(f"127.0.0.1:{port}", wait_for_ready=False) as ours:  # TLS from the env
                out["main"] = (await _calls(ours))["gateway"]
            out["tether health (tls)"] = await asyncio.to_thread(
                health.check_grpc, f"127.0.0.1:{port}", "", 5
            )
            out["tether health (probe port)"] = await asyncio.to_thread(
                health.check_grpc, f"127.0.0.1:{probe_port}", "", 5, True
            )
            await health_handle.set(False)
            out["probe after"] = await asyncio.to_thread(
                health.main, ["--grpc", f"127.0.0.1:{probe_port}", "--plaintext"]
            )
        finally:
            await server.stop(0)
            await health_handle.close(0)
        return out

    out = asyncio.run(main())
    assert out["probe health"] == health_pb2.HealthCheckResponse.SERVING
    assert out["probe other"] == grpc.StatusCode.UNIMPLEMENTED
    assert out["main plaintext health"] == UNAVAILABLE
    assert out["main"] == 7
    assert out["tether health (tls)"] is None and out["tether health (probe port)"] is None
    assert out["probe after"] == 1  # the probe sees the truth: NOT_SERVING


def _write(tmp_path: Path, pki, which: str) -> dict[str, str]:
    paths = {tls.CERT_ENV: "cert.pem", tls.KEY_ENV: "key.pem", tls.CA_ENV: "ca.pem"}
    data = {tls.CERT_ENV: pki[which].cert, tls.KEY_ENV: pki[which].key, tls.CA_ENV: pki["ca"]}
    out = {}
    for var, name in paths.items():
        (tmp_path / name).write_bytes(data[var])
        out[var] = str(tmp_path / name)
    return out


def test_settings_from_files(pki, tmp_path):
    env = _write(tmp_path, pki, "service")
    assert tls_from_env({}) is None  # nothing set: plaintext
    got = tls_from_env({**env, tls.SERVER_NAME_ENV: NAME})
    assert got == Tls(pki["service"].cert, pki["service"].key, pki["ca"], NAME)
    no_ca = tls_from_env({k: v for k, v in env.items() if k != tls.CA_ENV})
    assert no_ca is not None and no_ca.ca is None  # TLS, no client certificates asked for


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({tls.CERT_ENV: "/nonexistent/cert.pem"}, r"TETHER_TLS_CERT_FILE=/nonexistent/cert.pem: cannot read"),
        ({tls.CA_ENV: "EMPTY"}, r"TETHER_TLS_CA_FILE=.*: empty"),
        ({tls.KEY_ENV: "NOT_PEM"}, r"TETHER_TLS_KEY_FILE=.*: not a PEM file"),
        ({tls.KEY_ENV: ""}, r"TETHER_TLS_CERT_FILE is set but TETHER_TLS_KEY_FILE is not"),
        ({tls.CERT_ENV: "", tls.KEY_ENV: ""}, r"TETHER_TLS_CA_FILE is set but TETHER_TLS_CERT_FILE"),
    ],
)
def test_a_bad_file_stops_the_service_naming_the_setting(pki, tmp_path, change, message):
    (tmp_path / "empty").write_bytes(b"\n")
    (tmp_path / "garbage").write_bytes(b"hello")
    env = _write(tmp_path, pki, "service")
    for var, value in change.items():
        env[var] = {"EMPTY": str(tmp_path / "empty"), "NOT_PEM": str(tmp_path / "garbage")}.get(value, value)
    with pytest.raises(TlsSettingsError, match=message):
        tls_from_env(env)


def test_a_bad_file_stops_start_server_and_tether_health(pki, tmp_path, monkeypatch):
    monkeypatch.setenv(tls.CERT_ENV, str(tmp_path / "missing.pem"))
    monkeypatch.setenv(tls.KEY_ENV, str(tmp_path / "missing.key"))
    with pytest.raises(TlsSettingsError, match="TETHER_TLS_CERT_FILE"):
        asyncio.run(start_server(0, _register, token=""))
    assert "TETHER_TLS_CERT_FILE" in (health.check_grpc("127.0.0.1:1", "", 1) or "")
    monkeypatch.setenv(tls.HEALTH_PORT_ENV, "http")
    with pytest.raises(TlsSettingsError, match="TETHER_GRPC_HEALTH_PORT"):
        tls.health_port_from_env()
