"""Endpoints as tracers, collectors and relays name them: one parser and one loopback test
for all of them, so that a warning and a connection agree on what an address means."""
import ipaddress
import socket


def from_url(endpoint: str) -> tuple[str, bool]:
    """OpenTelemetry's URL form of an endpoint (http://host:port, https://host:port/) as
    gRPC's host:port, and whether it asks for TLS (https); anything else as it is."""
    scheme, sep, rest = endpoint.strip().partition("://")
    if sep and scheme.lower() in ("http", "https"):
        return rest.rstrip("/"), scheme.lower() == "https"
    return endpoint.strip(), False


GRPC_TARGETS = ("unix:", "unix-abstract:", "ipv4:", "ipv6:", "vsock:")   # gRPC's own forms, taken as they are


def target_of(endpoint: str) -> tuple[str, bool]:
    """(gRPC target, whether TLS is asked) of an endpoint as a user writes it: host:port,
    http(s)://host:port (https://host: port 443, as OpenTelemetry's exporters take it) or
    one of gRPC's own target forms; ValueError for anything else."""
    target, tls = from_url(endpoint)
    if target.startswith(GRPC_TARGETS):
        return target, tls
    if tls and not target.rpartition("]")[2].rpartition(":")[2].isdigit():   # (a [v6] address's colons aside)
        target += ":443"
    split_host_port(target)
    if "://" in target.replace("dns:///", ""):
        raise ValueError("a URL scheme other than http or https")
    return target, tls


def split_host_port(endpoint: str) -> tuple[str, int]:
    """"host:port", "[v6]:port" or a gRPC target "dns:///host:port" as (host, port)."""
    target = endpoint.split("///", 1)[-1]
    host, sep, port = target.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"expected HOST:PORT, got {endpoint!r}")
    if int(port) > 65535:
        raise ValueError(f"port {int(port)} is out of range (0-65535) in {endpoint!r}")
    return host.strip("[]"), int(port)


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or a name, resolved) reaches this machine only."""
    host = host.strip("[]")
    if not host:
        return False                # all interfaces
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        try:
            return all(ipaddress.ip_address(info[4][0]).is_loopback for info in socket.getaddrinfo(host, None))
        except (OSError, ValueError):
            return False
