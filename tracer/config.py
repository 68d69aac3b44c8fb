"""Tracer configuration from arguments, then CROSSTRACE_* environment variables, then defaults.

torchrun's RANK, WORLD_SIZE and LOCAL_RANK are picked up when present, and so are
OpenTelemetry's OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES, OTEL_SDK_DISABLED and
OTEL_TRACES_SAMPLER (as far as crosstrace can follow it), so that code configured for
the OpenTelemetry SDK keeps its settings. A malformed environment variable is reported
with a warning and its default is used: the tracer must never stop the program it traces.
"""
import dataclasses
import os
import socket
import sys
import urllib.parse
import warnings

import opentelemetry.trace

from ..proto.endpoint import target_of

ENV_PREFIX = "CROSSTRACE_"


@dataclasses.dataclass
class Config:
    endpoint: str = "127.0.0.1:4327"
    node_id: str = ""            # default: "<host>/rank<RANK>" under torchrun, else "<host>/<pid>"
    job_id: str = "default"
    role: str = ""
    service_name: str = ""
    labels: dict = dataclasses.field(default_factory=dict)   # the node's resource labels, "k=v,k2=v2" in the environment
    rank: int = -1
    world_size: int = 0
    local_rank: int = -1
    max_queue: int = 65536       # spans waiting for export; beyond this they are dropped and counted
    batch_size: int = 8192       # spans per exported batch
    # As OpenTelemetry's BatchSpanProcessor: a batch costs the process ~2 ms of CPU (its threads and
    # gRPC's, cold) however few spans it holds; a full batch (batch_size) goes at once.
    export_interval_ms: int = 5000
    max_unacked_mb: int = 64     # batches sent but not yet acked, kept for resending
    clock_probe_interval_s: float = 10.0
    clock_probe_burst: int = 8
    udp_clock: bool = True       # also probe the collector over UDP (kernel timestamps, ~us error)
    rpc_clock_interval_ms: float = 10.0   # a gRPC channel asks for a clock sample on one call per interval (0: every call)
    ntp_servers: str = ""        # comma-separated host[:port]: sample this node's offset to UTC
    ntp_interval_s: float = 64.0
    ptp_uds: str = ""            # ptp4l's UNIX socket (e.g. /var/run/ptp4l): sample it through pmc
    ptp_interval_s: float = 10.0
    sim_clock_offset_ns: int = 0
    sim_clock_drift_ppm: float = 0.0
    sim_clock_epoch_ns: int | None = None
    exit_flush_timeout_s: float = 5.0
    disabled: bool = False
    # Intermittent links: batches the collector has not acked go to disk while it is out of
    # reach, up to spool_max_mb (then the oldest are dropped and counted), and are replayed
    # on reconnect, also by the next process that spools there. Empty: kept in memory only.
    spool_dir: str = ""
    spool_max_mb: int = 256
    spool_fsync: bool = False   # each spooled batch on disk before it counts (survives a power loss)
    # Security: TLS to the collector (tls_ca: CA bundle that signed its certificate, else the
    # system's roots), a client certificate for mutual TLS, and a bearer token.
    tls: bool = False
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    token: str = dataclasses.field(default="", repr=False)  # never printed

    @property
    def uses_tls(self) -> bool:
        """TLS to the collector: asked for, or implied by a CA or a client certificate."""
        return bool(self.tls or self.tls_ca or self.tls_cert)

    @classmethod
    def from_env(cls, **overrides) -> "Config":
        """Arguments win over CROSSTRACE_* variables, which win over the defaults."""
        cfg = cls()
        env = os.environ
        for field in dataclasses.fields(cls):
            raw = env.get(ENV_PREFIX + field.name.upper())
            if raw is not None:
                _set_from_text(cfg, field, raw, ENV_PREFIX + field.name.upper())
        for name, env_name in (("rank", "RANK"), ("world_size", "WORLD_SIZE"), ("local_rank", "LOCAL_RANK")):
            if env.get(ENV_PREFIX + name.upper()) is None and env.get(env_name) is not None:
                _set_from_text(cfg, _FIELDS[name], env[env_name], env_name)
        for name, value in overrides.items():
            if name not in _FIELDS:
                raise TypeError(f"unknown crosstrace option {name!r}; known: {', '.join(sorted(_FIELDS))}")
            if value is not None:
                setattr(cfg, name, value)
        cfg.labels = _text_labels(cfg.labels)
        _check_counts(cfg)
        _check_endpoint(cfg)
        _follow_opentelemetry(cfg, env, given={name for name, value in overrides.items() if value is not None})
        for name, minimum in _MINIMUM.items():
            value = getattr(cfg, name)
            if not value >= minimum:
                default = _FIELDS[name].default
                _warn(f"crosstrace: {name}={value!r} is below its minimum {minimum}; using {default}")
                setattr(cfg, name, default)
        if not cfg.node_id:
            host = socket.gethostname()
            cfg.node_id = f"{host}/rank{cfg.rank}" if cfg.rank >= 0 else f"{host}/{os.getpid()}"
        return cfg


def _check_counts(cfg: Config) -> None:
    """Whole numbers where a field is an int: max_queue=1e6 is taken as 1000000 (it went on
    as a float into the export queue's bounds), and 2.5 or "10" given as an argument is
    reported and its default used."""
    for field in dataclasses.fields(cfg):
        value = getattr(cfg, field.name)
        if _kind(field) != "int" or isinstance(value, int):
            continue
        if isinstance(value, float) and value.is_integer():
            setattr(cfg, field.name, int(value))
        else:
            _warn(f"crosstrace: ignoring {field.name}={value!r}: expected a whole number; using {field.default}")
            setattr(cfg, field.name, field.default)


def _check_endpoint(cfg: Config) -> None:
    """host:port, taken also in OpenTelemetry's URL form (https:// then asks for TLS): a
    URL failed only once the exporter connected, and a malformed endpoint is reported now."""
    try:
        endpoint, tls = target_of(cfg.endpoint)
    except ValueError as exc:
        default = _FIELDS["endpoint"].default
        _warn(f"crosstrace: ignoring endpoint {cfg.endpoint!r} ({exc}); using {default}")
        endpoint, tls = default, False
    cfg.endpoint, cfg.tls = endpoint, cfg.tls or tls


def _follow_opentelemetry(cfg: Config, env, given: set) -> None:
    """OpenTelemetry's own variables, where neither an argument (`given`) nor a CROSSTRACE_*
    variable says otherwise."""
    if not cfg.labels and env.get("OTEL_RESOURCE_ATTRIBUTES"):
        cfg.labels = _labels(env["OTEL_RESOURCE_ATTRIBUTES"], "OTEL_RESOURCE_ATTRIBUTES")
    if not cfg.service_name:
        cfg.service_name = env.get("OTEL_SERVICE_NAME") or cfg.labels.get("service.name", "")
    if "disabled" in given or env.get(ENV_PREFIX + "DISABLED") is not None:
        return
    sampler = env.get("OTEL_TRACES_SAMPLER", "").strip().lower()
    off = "OTEL_SDK_DISABLED=true" if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true" else (
        "OTEL_TRACES_SAMPLER=always_off" if sampler == "always_off" else None)
    if off:
        cfg.disabled = True
        _warn(f"crosstrace: tracing is off, as {off} asks (CROSSTRACE_DISABLED=false or "
              "init(disabled=False) turns it on)")
    elif sampler not in ("", "always_on", "parentbased_always_on"):
        _warn(f"crosstrace: OTEL_TRACES_SAMPLER={sampler} is not followed: crosstrace records every span "
              "under a sampled parent, and samples training steps itself (crosstrace.step(k, every=N))")


def _text_labels(labels) -> dict:
    """Labels as the wire holds them, text to text (a GPU index given as 0, say)."""
    try:
        return {str(key): str(value) for key, value in dict(labels).items()}
    except (TypeError, ValueError):
        _warn(f"crosstrace: ignoring labels={labels!r}: expected a mapping")
        return {}


def _labels(raw: str, source: str) -> dict:
    """`key=value,key2=value2`, percent-encoded as OpenTelemetry's resource variable is."""
    labels = {}
    for item in filter(None, (part.strip() for part in raw.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            _warn(f"crosstrace: ignoring {item!r} in {source}: expected key=value")
            continue
        labels[urllib.parse.unquote(key.strip())] = urllib.parse.unquote(value.strip())
    return labels


def _warn(message: str) -> None:
    """A RuntimeWarning that points at the caller's line (its init(), TracerProvider() or,
    through the entry point, trace.get_tracer()), past crosstrace's and OpenTelemetry's
    frames, however deep in them the option was read."""
    frame, level = sys._getframe(1), 2
    while frame is not None and frame.f_code.co_filename.startswith(_OWN_DIRS):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, RuntimeWarning, stacklevel=level)


_OWN_DIRS = tuple(os.path.dirname(path) + os.sep for path in (
    sys.modules["crosstrace"].__file__, __file__, os.path.dirname(opentelemetry.trace.__file__)))
_FIELDS = {f.name: f for f in dataclasses.fields(Config)}
# Sizes and periods below these make the exporter spin or never send: such a value is
# reported and its default used.
_MINIMUM = {"max_queue": 1, "batch_size": 1, "export_interval_ms": 1, "max_unacked_mb": 1,
            "clock_probe_interval_s": 0.01, "clock_probe_burst": 1, "ntp_interval_s": 0.01,
            "ptp_interval_s": 0.01, "exit_flush_timeout_s": 0, "spool_max_mb": 1, "rpc_clock_interval_ms": 0}


_BOOLS = {**dict.fromkeys(("1", "true", "yes", "on"), True), **dict.fromkeys(("0", "false", "no", "off", ""), False)}
_ON_OFF = "true/false, 1/0, yes/no or on/off"   # what _BOOLS takes, as warnings say it


def flag_from_env(name: str) -> bool:
    """An on/off environment variable read as the Config's are: one that is neither is
    reported, and read as off."""
    raw = os.environ.get(name, "")
    try:
        return _BOOLS[raw.strip().lower()]
    except KeyError:
        _warn(f"crosstrace: ignoring {name}={raw!r}: expected {_ON_OFF}")
        return False


def _kind(field: dataclasses.Field) -> str:
    """A field's type as text ("int", "dict[str, str]", ...)."""
    return field.type if isinstance(field.type, str) else getattr(field.type, "__name__", str(field.type))


def _set_from_text(cfg: Config, field: dataclasses.Field, raw: str, source: str) -> None:
    kind = _kind(field)
    try:
        if kind.startswith("dict"):
            value = _labels(raw, source)
        elif kind.startswith("bool"):
            value = _BOOLS[raw.strip().lower()]   # a typo (CROSSTRACE_DISABLED=ture) is reported, not read as false
        elif kind.startswith("int"):
            value = int(raw)
        elif kind.startswith("float"):
            value = float(raw)
        else:
            value = raw
    except (ValueError, KeyError):
        expected = _ON_OFF if kind.startswith("bool") else kind
        _warn(f"crosstrace: ignoring {source}={raw!r}: expected {expected}")
        return
    setattr(cfg, field.name, value)
