"""The TGI-compatible server as a Ray Serve deployment: replicas behind Ray's HTTP proxy.

Each replica builds the same FastAPI app as ``spec-plugins serve`` (``create_app``: routes, TGI
error bodies, streaming, ``/v1/chat/completions``) around its own model and continuous batch, so
nothing of the HTTP behaviour is written twice. Ray Serve builds the app on the replica
(``serve.ingress`` with a builder function), runs its lifespan (the decode thread starts, and on
shutdown drains in-flight requests for ``shutdown_timeout`` seconds), routes requests to
replicas, restarts dead ones and scales on ongoing requests (``autoscale``).

``ray`` is imported only here (the ``[ray]`` extra); the single-machine server never needs it.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from spec_plugins.backends.llamacpp_config import MAX_THREADS
from spec_plugins.server.setup import DRAFT_POLICIES

INSTALL_HINT = "Ray Serve needs the [ray] extra: pip install -e '.[ray]' (or pip install 'ray[serve]')"
_REPLICA: dict[str, Any] = {}  # this process's replica state (one replica per Ray actor process)
# The least value of each numeric ReplicaOptions field, as `spec-plugins serve`'s options bound them
# (cli.py's typer ``min=``): field -> (int or float, least value, None allowed).
OPTION_BOUNDS: dict[str, tuple[type, float, bool]] = {
    "max_batch": (int, 1, False),
    "max_input_tokens": (int, 1, True),
    "max_total_tokens": (int, 2, True),
    "shutdown_timeout": (float, 0.0, False),
    "body_timeout": (float, 0.001, False),
    "cpu_workers": (int, 1, False),
    "threads": (int, 1, True),
}
# The same for Scaling (cli.py's ``--replicas``/``--num-cpus``/``--num-gpus`` ``min=``, and what Ray's
# deployment config needs of the rest): field -> (int or float, bound, bound excluded).
SCALING_BOUNDS: dict[str, tuple[type, float, bool]] = {
    "replicas": (int, 1, False),
    "num_cpus": (float, 0.0, False),
    "num_gpus": (float, 0.0, False),
    "target_ongoing_requests": (float, 0.0, True),
    "max_ongoing_requests": (int, 1, False),
}


@dataclass(frozen=True)
class ReplicaOptions:
    """What every replica builds: the SpecConfig (as a dict) and the server's options."""

    config: dict[str, Any]
    max_batch: int = 8
    max_input_tokens: int | None = None
    max_total_tokens: int | None = None
    draft_policy: str = "load"
    shutdown_timeout: float = 30.0
    threads: int | None = None  # torch threads per replica (None: its num_cpus)
    escape_special_tokens: bool = False  # chat message text spelling a special token stays text
    body_timeout: float = 30.0  # seconds a client has to send its whole request body (then 408)
    cpu_workers: int = 2  # threads parsing and tokenizing request bodies at once, per replica

    def __post_init__(self) -> None:
        """A Serve config file's ``args`` reach here without the CLI's checks; a bad value would
        build replicas that hang (``cpu_workers: 0``) or refuse every request (``body_timeout: 0``)
        behind a healthy ``/health``, so it is refused at deploy, naming the field."""
        if not isinstance(self.config, dict):
            raise ValueError(f"options.config must be a mapping (a SpecConfig), got {type(self.config).__name__}")
        for name, (kind, least, optional) in OPTION_BOUNDS.items():
            _check_bound(name, getattr(self, name), kind, least, optional)
        if self.threads is not None and self.threads > MAX_THREADS:
            raise ValueError(f"options.threads must be <= {MAX_THREADS}, got {self.threads!r}")
        if self.draft_policy not in DRAFT_POLICIES:
            raise ValueError(f"options.draft_policy must be one of {list(DRAFT_POLICIES)}, got {self.draft_policy!r}")
        if not isinstance(self.escape_special_tokens, bool):
            raise ValueError(f"options.escape_special_tokens must be true or false, got {self.escape_special_tokens!r}")
        lo, hi = self.max_input_tokens, self.max_total_tokens
        if lo is not None and hi is not None and lo >= hi:
            raise ValueError(f"options.max_input_tokens ({lo}) must be < options.max_total_tokens ({hi})")


def _check_bound(name: str, value: Any, kind: type, least: float, optional: bool, *,
                 where: str = "options", above: bool = False) -> None:
    """One ``OPTION_BOUNDS``/``SCALING_BOUNDS`` entry: the type (a bool is no number), finite, and at
    least ``least`` (more than it where ``above``)."""
    if value is None and optional:
        return
    numeric = isinstance(value, int) or (kind is float and isinstance(value, float))
    if (isinstance(value, bool) or not numeric or not math.isfinite(value) or value < least
            or (above and value == least)):
        what = "an integer" if kind is int else "a finite number"
        raise ValueError(f"{where}.{name} must be {what} {'>' if above else '>='} {least}, got {value!r}")


@dataclass(frozen=True)
class Scaling:
    """Replica count or autoscaling range, and each replica's resources."""

    replicas: int = 1
    autoscale: tuple[int, int] | None = None  # (min, max) replicas, scaled on ongoing requests
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    target_ongoing_requests: float = 4.0  # per replica, for the autoscaler
    max_ongoing_requests: int = 32  # per replica: the proxy queues beyond this

    def __post_init__(self) -> None:
        """A Serve config file's ``scaling`` reaches here without the CLI's checks: each value is held
        to the CLI's rule, or Ray's where the CLI sets it (Ray's own errors do not name the config
        field, and it takes ``target_ongoing_requests: 0``). A fixed count and a range both set the replica count; Ray
        would keep only the range (``deployment_options``), so giving both is refused, not half applied."""
        for name, (kind, bound, above) in SCALING_BOUNDS.items():
            _check_bound(name, getattr(self, name), kind, bound, False, where="scaling", above=above)
        if self.autoscale is not None:
            pair = self.autoscale
            if (not isinstance(pair, (tuple, list)) or len(pair) != 2
                    or not all(isinstance(x, int) and not isinstance(x, bool) for x in pair)):
                raise ValueError(f"scaling.autoscale must be [MIN, MAX] (two integers), got {pair!r}")
            _check_autoscale(pair[0], pair[1], f"scaling.autoscale {list(pair)}")
        if self.autoscale is not None and self.replicas != 1:
            raise ValueError(f"replicas {self.replicas} and autoscale {list(self.autoscale)} both set the replica "
                             "count: give one (autoscale starts at MIN replicas)")

    def deployment_options(self) -> dict[str, Any]:
        opts: dict[str, Any] = {"ray_actor_options": {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus},
                                "max_ongoing_requests": self.max_ongoing_requests}
        if self.autoscale is not None:
            lo, hi = self.autoscale
            opts["autoscaling_config"] = {"min_replicas": lo, "max_replicas": hi, "initial_replicas": lo,
                                          "target_ongoing_requests": self.target_ongoing_requests}
        else:
            opts["num_replicas"] = self.replicas
        return opts


def parse_autoscale(text: str) -> tuple[int, int]:
    """``MIN:MAX`` -> (min, max), 0 <= min <= max, max >= 1."""
    try:
        lo, hi = (int(x) for x in text.split(":"))
    except ValueError:
        raise ValueError(f"--autoscale {text!r}: expected MIN:MAX, e.g. 1:4") from None
    _check_autoscale(lo, hi, f"--autoscale {text!r}")
    return lo, hi


def _check_autoscale(lo: int, hi: int, shown: str) -> None:
    """The one autoscale range rule, for ``--autoscale`` and a config file's ``scaling.autoscale``."""
    if lo < 0 or hi < 1 or lo > hi:
        raise ValueError(f"{shown}: need 0 <= MIN <= MAX and MAX >= 1")


def build_replica_app(options: ReplicaOptions) -> Any:
    """On a replica: the decoder, its batch and scheduler, and the HTTP app around them."""
    import torch

    from spec_plugins.config import SpecConfig
    from spec_plugins.decoder import SpeculativeDecoder
    from spec_plugins.server.app import create_app
    from spec_plugins.server.setup import build_state

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if options.threads:
        torch.set_num_threads(options.threads)
    cfg = SpecConfig.parse(options.config)
    dec = SpeculativeDecoder.from_config(cfg)
    state = build_state(dec, options.max_batch, options.max_input_tokens, options.max_total_tokens,
                        options.draft_policy, model_id=cfg.target.model, cpu_workers=options.cpu_workers)
    state.shutdown_timeout = options.shutdown_timeout
    state.body_timeout = options.body_timeout
    state.escape_special_tokens = options.escape_special_tokens
    replica = _replica_id()
    state.info_extra["replica"] = replica
    state.metrics.labels = {"replica": replica}
    _REPLICA["state"] = state
    return create_app(state)


def _replica_id() -> str:
    try:
        from ray import serve

        ctx = serve.get_replica_context()
    except Exception:  # noqa: BLE001 - outside a Ray replica (the builder called directly)
        return f"pid-{os.getpid()}"
    rid = getattr(ctx, "replica_id", None)
    return str(getattr(rid, "unique_id", None) or getattr(ctx, "replica_tag", "") or os.getpid())


class SpecReplica:
    """The deployment class: Ray's health check asks what ``/health`` asks (``Scheduler.unhealthy``:
    the decode thread lives and its rounds do not all fail)."""

    def check_health(self) -> None:
        state = _REPLICA.get("state")
        problem = state.scheduler.unhealthy if state is not None else None
        if problem is not None:
            raise RuntimeError(f"this replica is unhealthy: {problem}")


def application(options: ReplicaOptions, scaling: Scaling = Scaling(), name: str = "spec-plugins") -> Any:
    """The Ray Serve application (``serve.run(application(...))``)."""
    try:
        from ray import serve
    except ImportError as exc:
        raise ImportError(INSTALL_HINT) from exc

    def build() -> Any:  # evaluated on each replica when it starts
        return build_replica_app(options)

    ingress = serve.ingress(build)(SpecReplica)
    dep = serve.deployment(ingress, name=name, graceful_shutdown_timeout_s=options.shutdown_timeout + 5,
                           health_check_period_s=5.0, **scaling.deployment_options())
    return dep.bind()


@dataclass
class RayServeConfig:
    """What ``spec-plugins serve --ray`` writes as a Ray Serve config file (``--write-config``)
    for ``serve deploy`` on a cluster."""

    options: ReplicaOptions
    scaling: Scaling
    host: str = "0.0.0.0"
    port: int = 8000
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """Replicas and resources are written once, in ``args.scaling`` (``app_from_args`` checks them
        and builds the deployment from them): a ``deployments`` entry beside it would override them
        in Ray, so an edit of ``args.scaling`` would be ignored without a word."""
        return {"proxy_location": "EveryNode", "http_options": {"host": self.host, "port": self.port},
                "applications": [{"name": "spec-plugins", "route_prefix": "/",
                                  "import_path": "spec_plugins.server.ray_serve:app_from_args",
                                  "args": {"options": asdict(self.options), "scaling": asdict(self.scaling)}}]}


def app_from_args(args: dict[str, Any]) -> Any:
    """Entry point for a Ray Serve config file (``import_path``): args are the dataclass fields."""
    sc = dict(args.get("scaling") or {})
    if sc.get("autoscale") is not None:
        sc["autoscale"] = tuple(sc["autoscale"])
    return application(ReplicaOptions(**args["options"]), Scaling(**sc))


PROXY_ADDRESS_API = "ray.serve.context._get_global_client().http_config"  # private: may move between releases


def proxy_address() -> tuple[str, int]:
    """The host and port Serve's HTTP proxies listen on, as the Serve controller holds them (its
    client keeps them, ``PROXY_ADDRESS_API``; ``serve.status()`` does not report them)."""
    from ray.serve.context import _get_global_client

    http = _get_global_client().http_config
    return http.host, http.port


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def error_line(text: str) -> str:
    """A Ray error text on one line, colour codes removed; of a traceback (a replica's, a proxy's)
    its last line, which names the exception and its message."""
    text = _ANSI.sub("", text).strip()
    if 'File "' in text or "Traceback (most recent call last)" in text:
        return text.splitlines()[-1].strip()
    return " ".join(text.split())


def ray_error_text(exc: BaseException) -> str:
    """What went wrong, in one line, for an error Ray raised: a task's or actor's error
    (``RayTaskError``) carries the remote exception as ``cause``, whose message says it."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, BaseException) and cause is not exc:
        return ray_error_text(cause)
    return error_line(str(exc)) or type(exc).__name__


def replica_errors(status: Any, app_name: str) -> list[str]:
    """Each failed deployment's error (``serve.status()``): ``serve.run`` raises only "failed to
    update the deployments", while the deployment's status message ends with the replica's traceback."""
    app = status.applications.get(app_name)
    if app is None:
        return []
    return [error_line(dep.message) for dep in app.deployments.values()
            if dep.status == "DEPLOY_FAILED" and dep.message]  # DeploymentStatus is a str enum
