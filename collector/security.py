"""Who may talk to the collector: TLS (a server certificate, optionally client certificates
for mutual TLS) and bearer tokens, one per client.

Tokens file: one client per line, `NAME TOKEN`, or a bare `TOKEN` (named after its line);
blank lines, lines that begin with `#`, and text after the second field that begins with
`#` are comments: a `#` in a token, at its start too, is part of it. A client sends `authorization: Bearer TOKEN`
(the tracer's CROSSTRACE_TOKEN; any OpenTelemetry exporter's headers option). Every token
is compared in constant time, all of them on every call, so the answer's timing says
nothing about which token came close. A call without a valid token is refused with
UNAUTHENTICATED before any handler runs: it stores nothing.
"""
import hmac
import ssl

import grpc

from ..proto.endpoint import is_loopback, split_host_port

AUTH_KEY = "authorization"
_BEARER = "bearer "


class SecurityConfigError(ValueError):
    """A certificate, key or tokens file that cannot be used; the message says which and why."""


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise SecurityConfigError(f"cannot read the {what} {path!r}: {exc.strerror}") from None
    if not data.strip():
        raise SecurityConfigError(f"the {what} {path!r} is empty")
    return data


def load_tokens(path: str) -> dict[str, bytes]:
    """client name -> token, from a tokens file (see the module docstring)."""
    tokens: dict[str, bytes] = {}
    for number, line in enumerate(_read(path, "tokens file").decode("utf-8", "replace").splitlines(), 1):
        fields = line.split()
        if not fields or fields[0].startswith("#"):
            continue
        comment = next((i for i, field in enumerate(fields[2:], 2) if field.startswith("#")), None)
        fields = fields[:comment]
        if len(fields) > 2:
            raise SecurityConfigError(f"{path}:{number}: expected `NAME TOKEN` or `TOKEN`")
        name, token = (fields[0], fields[1]) if len(fields) == 2 else (f"line{number}", fields[0])
        if len(token) < 16:
            whose = f"of {name!r} " if len(fields) == 2 else ""   # (a bare token's name is made up here)
            raise SecurityConfigError(f"{path}:{number}: the token {whose}is shorter than 16 characters")
        if name in tokens:
            raise SecurityConfigError(f"{path}:{number}: client {name!r} is listed twice")
        tokens[name] = token.encode()
    if not tokens:
        raise SecurityConfigError(f"the tokens file {path!r} lists no token")
    return tokens


def server_credentials(cert: str, key: str, client_ca: str | None = None) -> grpc.ServerCredentials:
    """TLS with this certificate chain and key; with `client_ca`, mutual TLS: clients must
    present a certificate signed by that CA."""
    pair = (_read(key, "TLS key"), _read(cert, "TLS certificate"))
    # Checked here: gRPC reports a certificate, key or CA it cannot use as a port it cannot bind.
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cert, key, password=_encrypted)
    except (ssl.SSLError, OSError) as exc:
        raise SecurityConfigError(f"the TLS certificate {cert} and key {key} are not a usable pair: {exc}") from None
    if not client_ca:
        return grpc.ssl_server_credentials([pair])
    ca = _read(client_ca, "client CA")
    try:
        ssl.create_default_context().load_verify_locations(cadata=ca.decode("ascii", "replace"))
    except (ssl.SSLError, ValueError) as exc:
        raise SecurityConfigError(f"the client CA {client_ca} holds no usable certificate: {exc}") from None
    return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=True)


def _encrypted() -> bytes:
    """The password callback of a key check: only an encrypted key asks for one (OpenSSL
    would otherwise prompt on the terminal), and gRPC cannot use such a key."""
    raise SecurityConfigError("the TLS key is encrypted (with a passphrase); gRPC needs it unencrypted")


def exposure_warning(listen: str, tls: bool, tokens: bool) -> str | None:
    """The warning to print when a collector listens beyond loopback unprotected."""
    try:
        host = split_host_port(listen)[0]
    except ValueError:
        return None     # not an address: binding it fails with its own clear error
    if is_loopback(host) or (tls and tokens):
        return None
    risks = ([] if tokens else ["send spans into the store"]) + ([] if tls else ["read the spans on the wire"])
    missing = " and ".join(what for what, have in (("TLS", tls), ("tokens", tokens)) if not have)
    return (f"warning: listening on {listen}, beyond loopback, without {missing}: whoever reaches this port "
            f"can {' and '.join(risks)} (see --tls-cert, --tls-key and --tokens)")


class TokenAuth(grpc.ServerInterceptor):
    """Refuses every call without `authorization: Bearer <a listed token>`."""

    def __init__(self, tokens: dict[str, bytes]):
        self._tokens = list(tokens.values())

    def authorized(self, metadata) -> bool:
        presented = b""
        for key, value in metadata or ():
            if key == AUTH_KEY:
                value = value if isinstance(value, str) else value.decode("latin-1")
                if value[:len(_BEARER)].lower() == _BEARER:
                    presented = value[len(_BEARER):].strip().encode()
                break
        else:
            return False
        ok = False
        for token in self._tokens:   # all of them, always: constant time in which one matched
            ok |= hmac.compare_digest(presented, token)
        return ok

    def intercept_service(self, continuation, handler_call_details):
        metadata = handler_call_details.invocation_metadata
        if self.authorized(metadata):
            return continuation(handler_call_details)
        has_header = any(key == AUTH_KEY for key, _ in metadata or ())
        message = ("invalid bearer token" if has_header else
                   "missing bearer token: send metadata `authorization: Bearer <token>` (CROSSTRACE_TOKEN)")
        handler = continuation(handler_call_details)
        return _refusing(handler, message) if handler is not None else None


def _refusing(handler, message: str):
    """A handler of the same shape as `handler` that answers UNAUTHENTICATED."""
    def refuse(request_or_iterator, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse)
    return grpc.unary_unary_rpc_method_handler(refuse)
