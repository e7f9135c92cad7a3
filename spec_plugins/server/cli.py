"""``spec-plugins serve``: a TGI-compatible HTTP server over the configured decoder."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Optional

import typer

from spec_plugins.cli import app, check_finite, check_output_file, fail, load_config, write_output

from spec_plugins.server.setup import DRAFT_POLICIES, build_state

log = logging.getLogger("spec_plugins.server")
APP_NAME = "spec-plugins"  # the Ray Serve application ``serve --ray`` runs


def _check_port(host: str, port: int) -> None:
    """Fail at once, naming the address, when the port cannot be bound (busy, or not ours)."""
    import socket

    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except OSError as exc:
        fail(f"--host {host} --port {port}: cannot listen there ({exc.strerror or exc})")


@app.command("serve")
def serve(
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="YAML/JSON SpecConfig (default: built-in)."),
    host: str = typer.Option("127.0.0.1", "--host", help="Bind address (loopback by default)."),
    port: int = typer.Option(8080, "--port", min=0, max=65535),
    max_batch: int = typer.Option(8, "--max-batch", min=1, help="Requests decoded together (slots)."),
    max_input_tokens: Optional[int] = typer.Option(None, "--max-input-tokens", min=1,
                                                   help="Longest prompt (default: half of --max-total-tokens)."),
    max_total_tokens: Optional[int] = typer.Option(None, "--max-total-tokens", min=2,
                                                   help="Prompt + new tokens per request (default: min(context, 2048))."),
    draft_policy: str = typer.Option("load", "--draft-policy",
                                     help="'load': shrink the draft length as the batch grows (measured cost); "
                                          "'fixed': always the configured length."),
    no_speculation: bool = typer.Option(False, "--no-speculation", help="Plain decoding (same batching)."),
    shutdown_timeout: float = typer.Option(30.0, "--shutdown-timeout", min=0.0,
                                           help="Seconds in-flight requests may finish after SIGTERM/SIGINT "
                                                "(then they end with an error event; 0: at once)."),
    body_timeout: float = typer.Option(30.0, "--body-timeout", min=0.001,
                                       help="Seconds a client has to send its whole request body (then 408)."),
    cpu_workers: int = typer.Option(2, "--cpu-workers", min=1,
                                    help="Threads parsing and tokenizing request bodies at once (off the event loop)."),
    header_timeout: float = typer.Option(10.0, "--header-timeout", min=0.001,
                                         help="Seconds a connection has for a request line and its headers "
                                              "(then 408 and close)."),
    max_header_bytes: int = typer.Option(8 << 10, "--max-header-bytes", min=256,
                                         help="Longest header line, bytes (then 431 and close)."),
    max_headers_bytes: int = typer.Option(64 << 10, "--max-headers-bytes", min=256,
                                          help="Request line and all headers of one request, bytes (then 431)."),
    idle_timeout: float = typer.Option(5.0, "--idle-timeout", min=0.001,
                                       help="Seconds a kept-alive connection may wait between requests."),
    max_connections: int = typer.Option(1024, "--max-connections", min=1,
                                        help="Open connections; past it the oldest without a request in "
                                             "progress is closed, and a few more are kept for /health and "
                                             "/metrics (others get 503)."),
    escape_special_tokens: bool = typer.Option(False, "--escape-special-tokens",
                                               help="Chat message text that spells a special token "
                                                    "(<|im_end|>) is encoded as text, not as the control "
                                                    "token (off: as transformers, TGI and vLLM)."),
    ray: bool = typer.Option(False, "--ray", help="Serve as a Ray Serve deployment (replicas behind Ray's proxy)."),
    replicas: Optional[int] = typer.Option(None, "--replicas", min=1,
                                           help="--ray: replicas, each with its model and batch (default 1)."),
    autoscale: Optional[str] = typer.Option(None, "--autoscale", help="--ray: MIN:MAX replicas, scaled on "
                                                                      "ongoing requests (instead of --replicas)."),
    ray_address: Optional[str] = typer.Option(None, "--ray-address", help="--ray: a running cluster, left "
                                                                          "running ('auto': RAY_ADDRESS's, else "
                                                                          "this machine's; 'local': a new local "
                                                                          "Ray; default: RAY_ADDRESS's cluster "
                                                                          "where it is set, else a new local Ray)."),
    num_cpus: float = typer.Option(1.0, "--num-cpus", min=0.0, help="--ray: CPUs per replica."),
    num_gpus: float = typer.Option(0.0, "--num-gpus", min=0.0, help="--ray: GPUs per replica."),
    write_config: Optional[Path] = typer.Option(None, "--write-config",
                                                help="--ray: write a Ray Serve config file for `serve deploy` "
                                                     "and exit."),
) -> None:
    """Serve the text-generation-inference HTTP API with continuous batching and speculation."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if draft_policy not in DRAFT_POLICIES:
        fail(f"--draft-policy must be 'load' or 'fixed', got {draft_policy!r}")
    for flag, value in (("--shutdown-timeout", shutdown_timeout), ("--body-timeout", body_timeout),
                        ("--num-cpus", num_cpus), ("--num-gpus", num_gpus), ("--header-timeout", header_timeout),
                        ("--idle-timeout", idle_timeout)):
        check_finite(value, flag)
    if max_input_tokens is not None and max_total_tokens is not None and max_input_tokens >= max_total_tokens:
        fail(f"--max-input-tokens ({max_input_tokens}) must be < --max-total-tokens ({max_total_tokens})")
    try:
        from spec_plugins.server.connections import ConnectionLimits, ensure_file_limit
    except ImportError as exc:
        fail(f"the server needs the [server] extra (pip install -e '.[server]'): {exc}")
        return
    limits = ConnectionLimits(header_timeout, max_header_bytes, max_headers_bytes, idle_timeout, max_connections)
    if (ray or write_config is not None) and limits != ConnectionLimits():
        fail("--header-timeout, --max-header-bytes, --max-headers-bytes, --idle-timeout and --max-connections "
             "apply to the single-machine server; with --ray, Ray Serve's proxy holds the connections")
    ray_only = [flag for flag, given in (("--replicas", replicas is not None), ("--autoscale", autoscale is not None),
                                         ("--ray-address", ray_address is not None), ("--num-cpus", num_cpus != 1.0),
                                         ("--num-gpus", num_gpus != 0.0)) if given]
    if ray_only and not (ray or write_config is not None):
        fail(f"{', '.join(ray_only)} configure Ray Serve replicas: add --ray (or --write-config), or leave them out "
             "for the single-machine server")
    if replicas is not None and autoscale is not None:  # before anything is written or started
        fail(f"--replicas {replicas} and --autoscale {autoscale} both set the replica count: give one "
             "(--autoscale starts at MIN replicas and scales between MIN and MAX)")
    if write_config is not None:
        check_output_file(write_config, "--write-config")
    if ray or write_config is not None:
        _serve_ray(config, host, port, max_batch, max_input_tokens, max_total_tokens, draft_policy, no_speculation,
                   shutdown_timeout, replicas, autoscale, ray_address, num_cpus, num_gpus, write_config,
                   escape_special_tokens, body_timeout, cpu_workers)
        return
    try:
        limits.check()
        ensure_file_limit(limits)
    except ValueError as exc:
        fail(exc)
    _check_port(host, port)  # before the model loads (tens of seconds)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        from spec_plugins.server.app import http_server
    except ImportError as exc:
        fail(f"the server needs the [server] extra (pip install -e '.[server]'): {exc}")
        return
    from spec_plugins.config import ConfigError
    from spec_plugins.decoder import SpeculativeDecoder

    try:
        cfg = load_config(config)
        if no_speculation:
            cfg = cfg.model_copy(update={"proposer": None})
        dec = SpeculativeDecoder.from_config(cfg)
        state = build_state(dec, max_batch, max_input_tokens, max_total_tokens, draft_policy,
                            model_id=cfg.target.model, cpu_workers=cpu_workers)
    except (ConfigError, ValueError, FileNotFoundError, LookupError) as exc:
        fail(exc)
        return
    state.shutdown_timeout = shutdown_timeout
    state.body_timeout = body_timeout
    state.escape_special_tokens = escape_special_tokens
    if host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("binding %s: the server has no authentication", host)
    server, _ = http_server(state, host, port, limits, log_level="info")
    server.run()


def _serve_ray(config: Optional[Path], host: str, port: int, max_batch: int, max_input_tokens: Optional[int],
               max_total_tokens: Optional[int], draft_policy: str, no_speculation: bool, shutdown_timeout: float,
               replicas: Optional[int], autoscale: Optional[str], ray_address: Optional[str], num_cpus: float,
               num_gpus: float,
               write_config: Optional[Path], escape_special_tokens: bool = False, body_timeout: float = 30.0,
               cpu_workers: int = 2) -> None:
    """``serve --ray``: the same app on Ray Serve replicas (``spec_plugins.server.ray_serve``).
    Connections are Ray's proxy's (its own timeouts): the connection limits above are not applied."""
    import json

    from spec_plugins.backends.llamacpp_config import MAX_THREADS
    from spec_plugins.config import ConfigError
    from spec_plugins.server.ray_serve import (INSTALL_HINT, RayServeConfig, ReplicaOptions, Scaling, application,
                                               parse_autoscale)

    if int(num_cpus) > MAX_THREADS:  # each replica runs int(--num-cpus) torch threads
        fail(f"--num-cpus {num_cpus:g}: each replica runs one torch thread per CPU, at most {MAX_THREADS}")
    try:
        cfg = load_config(config)
        if no_speculation:
            cfg = cfg.model_copy(update={"proposer": None})
        # what was given, not every default: each replica parses it again, and some checks look at
        # which fields a config gives (a default written out reads as given)
        replica_cfg = cfg.model_dump(mode="json", exclude_unset=True)
        opts = ReplicaOptions(replica_cfg, max_batch, max_input_tokens, max_total_tokens, draft_policy,
                              shutdown_timeout, max(1, int(num_cpus)) if num_cpus >= 1 else None,
                              escape_special_tokens, body_timeout, cpu_workers)
        scaling = Scaling(1 if replicas is None else replicas, parse_autoscale(autoscale) if autoscale else None,
                          num_cpus, num_gpus, max_ongoing_requests=max(2 * max_batch, 8))
    except (ConfigError, ValueError, FileNotFoundError, LookupError) as exc:
        fail(exc)
        return
    if write_config is not None:
        import yaml

        text = yaml.safe_dump(RayServeConfig(opts, scaling, host, port).to_dict(), sort_keys=False)
        write_output(write_config, text, "--write-config")
        typer.echo(f"wrote {write_config}: deploy it with `serve deploy {write_config}` on the cluster")
        return
    address_from = "--ray-address"
    if ray_address is None and os.environ.get("RAY_ADDRESS"):  # set by `ray job submit` for its entrypoint
        ray_address, address_from = os.environ["RAY_ADDRESS"], "RAY_ADDRESS"
        typer.secho(f"joining the Ray cluster in RAY_ADDRESS ({ray_address}), left running at stop "
                    "(--ray-address local: a new local Ray instead)", err=True, fg=typer.colors.CYAN)
    started_here = ray_address in (None, "local")  # a Ray of this command's own
    if started_here:
        _check_port(host, port)  # before Ray starts and the replicas load
    try:
        import ray as ray_mod
        from ray import serve
    except ImportError:
        fail(INSTALL_HINT)
        return
    shown = f"autoscale {autoscale}" if autoscale else f"{scaling.replicas} replica(s)"
    _run_on_ray(ray_mod, serve, ray_address, started_here, host, port, application(opts, scaling), shown,
                address_from)
    typer.echo(json.dumps({"stopped": True}))


class _StartFailed(Exception):
    """A start-up step failed: its message is printed as ``error:`` once Ray has stopped."""


def _interrupt(signum: int, frame: Any) -> None:
    """SIGTERM as Ctrl-C: the start-up or serving step under way is left and ``_run_on_ray`` stops."""
    raise KeyboardInterrupt


def _run_on_ray(ray_mod: Any, serve: Any, ray_address: Optional[str], started_here: bool, host: str, port: int,
                app: Any, shown: str, address_from: str = "--ray-address") -> None:
    """Start or join Ray, deploy, serve until SIGTERM/Ctrl-C, then stop, after a failed or interrupted
    start-up too. SIGTERM is ours from before ``ray.init`` and again after it (``ray.init`` replaces
    it; a SIGTERM then ended the command with Ray's C++ stack dump); a second SIGTERM does not cut
    the drain short.
    A failed step's error is printed last, after Ray's own clean-up lines."""
    import signal
    import time

    previous = signal.signal(signal.SIGTERM, _interrupt)
    deployed, problem = False, None
    try:
        _connect(ray_mod, ray_address, address_from)
        signal.signal(signal.SIGTERM, _interrupt)
        _start_serve(serve, host, port, started_here)
        _check_name_free(serve)
        deployed = True  # from here our app may exist on the cluster: deleted on the way out
        _deploy(serve, app)
        typer.secho(f"serving on http://{host}:{port} via Ray Serve ({shown}); Ctrl-C to stop",
                    err=True, fg=typer.colors.CYAN)
        while True:
            time.sleep(1.0)
    except KeyboardInterrupt:
        pass
    except _StartFailed as exc:
        problem = str(exc)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            _stop_serve(serve, ray_mod, started_here, deployed)
        finally:
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
    if problem is not None:
        fail(problem)


def _connect(ray_mod: Any, ray_address: Optional[str], address_from: str = "--ray-address") -> None:
    """``ray.init``: with no address a new local Ray ("local": never a cluster found on the machine,
    whose Serve this command must not shut down); ``address_from`` names where the address came from
    (the flag, or RAY_ADDRESS) in the error."""
    from spec_plugins.server.ray_serve import ray_error_text

    try:
        ray_mod.init(address=ray_address or "local", include_dashboard=False)
    except Exception as exc:  # noqa: BLE001 - Ray raises many types (ValueError, ConnectionError, ...)
        where = f"{address_from} {ray_address}: cannot connect" if ray_address else "cannot start a local Ray"
        raise _StartFailed(f"{where} ({ray_error_text(exc)})") from None


def _start_serve(serve: Any, host: str, port: int, started_here: bool = False) -> None:
    """``serve.start``, then the proxy's address as Serve holds it: on a cluster where Serve already
    runs, Serve keeps its proxies' host and port and ignores ours, so a differing one is refused
    rather than announcing an address nothing listens on. The address is read through Ray's private
    API (``PROXY_ADDRESS_API``); where this Ray lacks it, a Serve this command started on its own Ray
    took our host and port anyway, while on a joined cluster the check cannot be made and is refused."""
    import ray

    from spec_plugins.server.ray_serve import PROXY_ADDRESS_API, proxy_address, ray_error_text

    try:
        serve.start(http_options={"host": host, "port": port})
    except Exception as exc:  # noqa: BLE001 - a proxy that cannot bind comes back as a RayTaskError
        raise _StartFailed(f"--host {host} --port {port}: Ray Serve's proxy cannot listen there "
                           f"({ray_error_text(exc)})") from None
    try:
        actual = proxy_address()
    except (ImportError, AttributeError) as exc:  # moved in another Ray release
        if started_here:
            return
        raise _StartFailed(f"--host {host} --port {port}: cannot tell whether the running Ray Serve proxy listens "
                           f"there (Serve keeps the address it first started with): Ray {ray.__version__} has no "
                           f"{PROXY_ADDRESS_API} to read it from ({exc}); upgrade or downgrade Ray to a version "
                           "that has it") from None
    if actual != (host, port):
        raise _StartFailed(f"--host {host} --port {port}: Ray Serve already runs on this cluster with its "
                           f"proxy on {actual[0]}:{actual[1]} (fixed while Serve runs): give "
                           f"--host {actual[0]} --port {actual[1]}")


def _check_name_free(serve: Any) -> None:
    """``serve.run`` replaces an app of the same name without a word, and our stop would then delete
    it: an app named ``APP_NAME`` already on the cluster (a `serve deploy` of a --write-config file,
    another ``serve --ray``) is another deployment's, so the command is refused and leaves it."""
    from spec_plugins.server.ray_serve import ray_error_text

    try:
        found = serve.status().applications.get(APP_NAME)
    except Exception as exc:  # noqa: BLE001 - Ray raises many types
        raise _StartFailed(f"cannot read Ray Serve's applications ({ray_error_text(exc)})") from None
    if found is not None:
        raise _StartFailed(f"Ray Serve on this cluster already has an application named {APP_NAME!r} (status "
                           f"{getattr(found.status, 'value', found.status)}), owned by another deployment: it is "
                           f"left as it is; remove it first (serve.delete({APP_NAME!r}) from a Ray driver, or "
                           "`serve shutdown` for all of Serve) to serve this one there")


def _deploy(serve: Any, app: Any) -> None:
    """``serve.run``; a deployment whose replicas fail to start is named with the replica's error,
    a deploy Serve refuses (a route prefix another app holds) with Serve's reason."""
    from spec_plugins.server.ray_serve import ray_error_text, replica_errors

    try:
        serve.run(app, name=APP_NAME, route_prefix="/")
    except Exception as exc:  # noqa: BLE001 - Ray raises many types
        try:
            errors = replica_errors(serve.status(), APP_NAME)
        except Exception:  # noqa: BLE001 - the status is a detail; serve.run's error still says it
            errors = []
        if errors:
            raise _StartFailed(f"the replicas of {APP_NAME!r} failed to start: {'; '.join(errors)}") from None
        raise _StartFailed(f"Ray Serve refused to deploy {APP_NAME!r}: {ray_error_text(exc)}") from None


def _stop_serve(serve: Any, ray_mod: Any, started_here: bool, deployed: bool) -> None:
    """Delete our app first: its replicas drain (each app's lifespan waits up to --shutdown-timeout)
    while Ray's proxy still carries their streams to the clients. ``serve.shutdown`` takes down every
    app and proxy of the cluster, so it runs only on a Ray this command started (then Ray stops with
    ``ray.shutdown``); on a --ray-address cluster ``ray.shutdown`` only disconnects."""
    try:
        if deployed and ray_mod.is_initialized():
            serve.delete(APP_NAME)
    finally:
        try:
            if started_here and ray_mod.is_initialized():
                serve.shutdown()
        finally:
            ray_mod.shutdown()
