"""TLS, mutual TLS and bearer tokens on a real collector process: the right client gets in;
a missing or wrong token, a wrong CA, a missing client certificate and plaintext to a TLS
port are refused with clear errors, and nothing is stored. Certificates are made here."""
import datetime
import ipaddress
import os
import subprocess
import sys
import textwrap

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from crosstrace.collector.security import load_tokens
from crosstrace.launch import CollectorProcess, wait_until
from crosstrace.proto import pb

from .conftest import first_line, run_python, span_count, tracer_env
from .test_collector_input import EXPORT, batch

TOKEN = "t0k3n-for-the-edge-camera-0001"
OTHER_TOKEN = "t0k3n-for-the-cloud-service-02"


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _cert(subject: str, key, issuer_name: str, issuer_key, ca: bool, server: bool = False):
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(_name(issuer_name))
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if server:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _write(path, *objects) -> str:
    data = b""
    for obj in objects:
        if isinstance(obj, x509.Certificate):
            data += obj.public_bytes(serialization.Encoding.PEM)
        else:
            data += obj.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                      serialization.NoEncryption())
    path.write_bytes(data)
    return str(path)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict:
    """Two CAs (the real one and a stranger), a server certificate for 127.0.0.1, a client
    certificate, and a tokens file."""
    d = tmp_path_factory.mktemp("pki")
    out = {}
    keys = {name: ec.generate_private_key(ec.SECP256R1()) for name in ("ca", "other_ca", "server", "client")}
    ca = _cert("crosstrace test CA", keys["ca"], "crosstrace test CA", keys["ca"], ca=True)
    other = _cert("someone else's CA", keys["other_ca"], "someone else's CA", keys["other_ca"], ca=True)
    out["ca"], out["other_ca"] = _write(d / "ca.pem", ca), _write(d / "other_ca.pem", other)
    out["server_cert"] = _write(d / "server.pem", _cert("collector", keys["server"], "crosstrace test CA",
                                                        keys["ca"], ca=False, server=True))
    out["server_key"] = _write(d / "server.key", keys["server"])
    out["client_cert"] = _write(d / "client.pem", _cert("edge-camera", keys["client"], "crosstrace test CA",
                                                        keys["ca"], ca=False))
    out["client_key"] = _write(d / "client.key", keys["client"])
    (d / "tokens").write_text(f"# clients\nedge-camera {TOKEN}\ncloud {OTHER_TOKEN}\n")
    out["tokens"] = str(d / "tokens")
    return out


def export(channel, metadata=None):
    """One batch over a raw Export stream: (acks, error)."""
    call = channel.stream_stream(EXPORT, request_serializer=None, response_deserializer=pb.ExportAck.FromString)
    try:
        return list(call(iter([batch(3).SerializeToString()]), timeout=10, metadata=metadata)), None
    except grpc.RpcError as err:
        return [], err


def test_tokens_missing_or_wrong_are_unauthenticated(tmp_path, pki):
    with CollectorProcess(str(tmp_path / "store.db"), extra_args=("--tokens", pki["tokens"])) as collector:
        with grpc.insecure_channel(collector.address) as channel:
            _, missing = export(channel)
            _, wrong = export(channel, [("authorization", "Bearer not-a-token-at-all-1234")])
            _, not_bearer = export(channel, [("authorization", f"Basic {TOKEN}")])
            clock = channel.unary_unary("/crosstrace.v1.Collector/ExchangeClock", request_serializer=None,
                                        response_deserializer=None)
            with pytest.raises(grpc.RpcError) as clock_err:
                clock(pb.ClockProbe(node_id="x", t1=1).SerializeToString(), timeout=10)
            otlp = channel.unary_unary("/opentelemetry.proto.collector.trace.v1.TraceService/Export",
                                       request_serializer=None, response_deserializer=None)
            with pytest.raises(grpc.RpcError) as otlp_err:
                otlp(b"", timeout=10)
            assert span_count(collector.store) == 0          # nothing got in
            acks, error = export(channel, [("authorization", f"Bearer {OTHER_TOKEN}")])
    assert missing.code() == grpc.StatusCode.UNAUTHENTICATED and "missing bearer token" in missing.details()
    for err in (wrong, not_bearer):
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED and err.details() == "invalid bearer token"
    for err in (clock_err.value, otlp_err.value):
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED
    assert error is None and [a.accepted for a in acks] == [3]
    assert span_count(collector.store) == 3


CLIENT = """
import logging, sys, crosstrace
logging.basicConfig(level=logging.WARNING, format="%(message)s")
provider = crosstrace.init()
tracer = provider.get_tracer("t")
for i in range(50):
    with tracer.start_as_current_span("secured", attributes={"i": i}):
        pass
print("flushed", provider.force_flush(int(sys.argv[1])))
provider.shutdown(timeout_millis=100)
"""


def tls_collector(tmp_path, pki, *extra) -> CollectorProcess:
    return CollectorProcess(str(tmp_path / "store.db"), extra_args=(
        "--tls-cert", pki["server_cert"], "--tls-key", pki["server_key"], "--tokens", pki["tokens"], *extra))


def test_tracer_over_tls_with_token_delivers(tmp_path, pki):
    with tls_collector(tmp_path, pki) as collector:
        env = tracer_env(collector, "secure-edge", tls_ca=pki["ca"], token=TOKEN)
        out = run_python(CLIENT, env, timeout=60, args=("20000",))
        assert out.stdout.strip() == "flushed True", out.stderr
        assert span_count(collector.store) == 50
    assert not [line for line in collector.stderr_lines if "warning" in line]   # loopback: no warning


@pytest.mark.parametrize("case", ["wrong_ca", "plaintext", "wrong_token"])
def test_refused_tracers_store_nothing_and_say_why(tmp_path, pki, case):
    with tls_collector(tmp_path, pki) as collector:
        options = {"wrong_ca": dict(tls_ca=pki["other_ca"], token=TOKEN),
                   "plaintext": dict(token=TOKEN),
                   "wrong_token": dict(tls_ca=pki["ca"], token="definitely-the-wrong-token")}[case]
        out = run_python(CLIENT, tracer_env(collector, case, **options), timeout=60, args=("2000",))
        assert out.stdout.strip() == "flushed False"     # the traced program carried on
        assert span_count(collector.store) == 0
    expected = {"wrong_ca": "CERTIFICATE_VERIFY_FAILED", "plaintext": "if it serves TLS, set CROSSTRACE_TLS_CA",
                "wrong_token": "refuses this tracer (UNAUTHENTICATED: invalid bearer token)"}[case]
    assert expected in out.stderr, out.stderr


def test_a_tls_tracer_told_of_a_plaintext_collector(tmp_path):
    """TLS to a plaintext collector printed gRPC's raw log lines, and no hint; plaintext to a
    TLS collector had one (above)."""
    with CollectorProcess(str(tmp_path / "store.db")) as collector:
        out = run_python(CLIENT, tracer_env(collector, "tls-to-plain", tls="true"), timeout=60, args=("2000",))
        assert out.stdout.strip() == "flushed False"
    assert "a TLS handshake failed: if the collector serves plaintext" in out.stderr, out.stderr
    assert "ssl_transport_security" not in out.stderr   # gRPC's own INFO lines


def test_mutual_tls_requires_a_client_certificate(tmp_path, pki):
    with tls_collector(tmp_path, pki, "--tls-client-ca", pki["ca"]) as collector:
        ca = open(pki["ca"], "rb").read()
        anonymous = grpc.ssl_channel_credentials(root_certificates=ca)
        with grpc.secure_channel(collector.address, anonymous) as channel:
            _, error = export(channel, [("authorization", f"Bearer {TOKEN}")])
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        assert span_count(collector.store) == 0
        env = tracer_env(collector, "mtls-edge", tls_ca=pki["ca"], tls_cert=pki["client_cert"],
                         tls_key=pki["client_key"], token=TOKEN)
        out = run_python(CLIENT, env, timeout=60, args=("20000",))
        assert out.stdout.strip() == "flushed True", out.stderr
        assert span_count(collector.store) == 50


def test_listening_beyond_loopback_unprotected_warns(tmp_path, pki):
    with CollectorProcess(str(tmp_path / "open.db"), listen="0.0.0.0:0") as open_collector:
        assert wait_until(lambda: open_collector.stderr_lines, 10)
        warning = "".join(open_collector.stderr_lines)
    assert "beyond loopback, without TLS and tokens" in warning
    assert f"listening on 0.0.0.0:{open_collector.port}," in warning   # the port it bound, not 0
    with tls_collector(tmp_path, pki) as guarded:
        pass
    assert not any("warning" in line for line in guarded.stderr_lines)


def test_bad_security_options_are_clear_errors(tmp_path, pki):
    short = tmp_path / "short-tokens"
    short.write_text("edge abc\n")
    bare = tmp_path / "bare-short-token"   # a bare token: no client name made up in the message
    bare.write_text("garbage\n")
    key = serialization.load_pem_private_key(open(pki["server_key"], "rb").read(), None)
    encrypted = tmp_path / "encrypted.key"
    encrypted.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                            serialization.BestAvailableEncryption(b"secret")))
    encrypted = str(encrypted)
    cases = [(["--tokens", str(short)], "the token of 'edge' is shorter than 16 characters"),
             (["--tokens", str(bare)], f"{bare}:1: the token is shorter than 16 characters"),
             (["--tokens", str(tmp_path / "absent")], "cannot read the tokens file"),
             (["--tls-cert", pki["server_cert"]], "--tls-cert and --tls-key go together"),
             (["--tls-cert", pki["server_cert"], "--tls-key", str(tmp_path / "absent.key")], "cannot read the TLS key"),
             # a certificate gRPC cannot use was reported as an address it could not bind
             (["--tls-cert", str(short), "--tls-key", str(short)], "not a usable pair"),
             # so was a client CA that holds no certificate (here a key)
             (["--tls-cert", pki["server_cert"], "--tls-key", pki["server_key"], "--tls-client-ca",
               pki["server_key"]], "holds no usable certificate"),
             # an encrypted key made OpenSSL prompt for its passphrase on the terminal
             (["--tls-cert", pki["server_cert"], "--tls-key", encrypted], "the TLS key is encrypted")]
    for args, message in cases:
        out = subprocess.run([sys.executable, "-m", "crosstrace", "collector", "--store", str(tmp_path / "x.db"),
                              "--listen", "127.0.0.1:0", *args], capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and message in out.stderr, (args, out.stderr)


def test_a_hash_inside_a_token_is_part_of_it(tmp_path):
    """`#` started a comment anywhere in a line: `edge abcdefghijklmnop#qrstuv` loaded the
    prefix, which was then the token accepted, and the full one refused."""
    path = tmp_path / "tokens"
    path.write_text("# clients\nedge abcdefghijklmnop#qrstuv  # the camera\n  # indented comment\n"
                    "training-cluster-east #Zx9q2LmP7vR4tK8w\n")
    assert load_tokens(str(path)) == {"edge": b"abcdefghijklmnop#qrstuv",
                                      "training-cluster-east": b"#Zx9q2LmP7vR4tK8w"}


def test_a_plaintext_collector_that_goes_away_gets_no_tls_hint(collector):
    """The hint is for a first connection a TLS server closes, not for a collector that
    served this tracer and was then killed (a relay restarting said to set a TLS CA)."""
    code = """
        import crosstrace, sys
        p = crosstrace.init()
        t = p.get_tracer("t")
        t.start_span("before").end()
        print(p.force_flush(20000), flush=True)
        sys.stdin.readline()                   # the collector is killed meanwhile
        t.start_span("after").end()
        p.force_flush(1500)
    """
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **tracer_env(collector, "served")})
    try:
        assert first_line(proc).strip() == "True"
        collector.kill()
        _, err = proc.communicate("go\n", timeout=60)
    finally:
        proc.kill()
    assert "export stream" in err and "TLS" not in err, err
