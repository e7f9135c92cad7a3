"""``spec-plugins serve --ray`` beside other Serve apps, and its start-up errors (round 18).

On a cluster given by ``--ray-address`` stopping deleted our app and then ran ``serve.shutdown``,
which took every other app on the cluster down with it; ``--host/--port`` differing from the running
Serve's proxy were ignored while the command announced them; a written Serve config gave replicas
twice (Ray's ``deployments`` entry overrode the checked ``args.scaling``); start-up failures were
tracebacks (a busy port, a bad address, a replica that cannot build), and a SIGTERM during start-up
ended with Ray's C++ stack dump. The cluster here is another process's, as a user's would be."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import typer
import yaml
from typer.testing import CliRunner

ray = pytest.importorskip("ray", reason="Ray Serve tests need the [ray] extra")
serve = pytest.importorskip("ray.serve")
httpx = pytest.importorskip("httpx")

from spec_plugins.cli import app  # noqa: E402
from spec_plugins.server import cli as server_cli  # noqa: E402
from spec_plugins.server.ray_serve import Scaling  # noqa: E402
from support import free_port  # noqa: E402
from test_ray_serve import model_dir  # noqa: E402,F401 (its fixture)


ENV = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {
    "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "token"}  # token: an explicit address too
CLI = [sys.executable, "-c", "from spec_plugins.cli import app; app()", "serve", "--ray", "--num-cpus", "0.5"]
# Another user's cluster: Ray, Serve's proxy on the given port and an app "other" at /other.
HOST = """
import signal, sys, ray
from ray import serve
ctx = ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
serve.start(http_options={"host": "127.0.0.1", "port": int(sys.argv[1])})
@serve.deployment(ray_actor_options={"num_cpus": 0.1})
class Other:
    def __call__(self, request):
        return "other app alive"
serve.run(Other.bind(), name="other", route_prefix="/other")
signal.signal(signal.SIGTERM, lambda *_: None)
print("GCS", ctx.address_info["gcs_address"], flush=True)
signal.pause()
serve.shutdown()
ray.shutdown()
"""


@pytest.fixture(scope="module")
def tiny(model_dir):  # noqa: F811 (the fixture imported above)
    """test_ray_serve's tiny model (1024 positions) with its word-level tokenizer."""
    return model_dir


def _spec_config(tmp_path, model) -> str:
    cfg = tmp_path / "spec.yaml"
    cfg.write_text(yaml.safe_dump({"target": {"backend": "torch", "model": str(model)}}))
    return str(cfg)


def test_the_written_config_gives_replicas_and_resources_once(tmp_path, tiny):
    """Only ``args.scaling`` (checked by ``Scaling``) sets them: no ``deployments`` entry overrides it."""
    out = tmp_path / "serve.yaml"
    res = CliRunner().invoke(app, ["serve", "--ray", "-c", _spec_config(tmp_path, tiny), "--replicas", "2",
                                   "--num-cpus", "0.5", "--write-config", str(out)])
    assert res.exit_code == 0, res.output
    entry = yaml.safe_load(out.read_text())["applications"][0]
    assert "deployments" not in entry, entry.get("deployments")
    assert Scaling(**entry["args"]["scaling"]) == Scaling(2, None, 0.5, 0.0, max_ongoing_requests=16)


def test_num_cpus_past_the_thread_limit_names_the_flag(tmp_path, tiny):
    out = tmp_path / "serve.yaml"
    res = CliRunner().invoke(app, ["serve", "--ray", "-c", _spec_config(tmp_path, tiny), "--num-cpus", "5000",
                                   "--write-config", str(out)])
    assert res.exit_code == 2 and "error: --num-cpus 5000" in res.output, res.output
    assert not out.exists()


def test_a_busy_port_is_refused_before_ray_starts(tmp_path, tiny, monkeypatch):
    def no_ray(*args, **kwargs):
        raise AssertionError("Ray was started")

    monkeypatch.setattr(ray, "init", no_ray)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        res = CliRunner().invoke(app, ["serve", "--ray", "-c", _spec_config(tmp_path, tiny),
                                       "--port", str(port)])
    assert res.exit_code == 2 and f"--port {port}: cannot listen there" in res.output, (res.output, res.exception)


def test_a_bad_ray_address_is_an_error_line(tmp_path, tiny):
    before = signal.getsignal(signal.SIGTERM)
    res = CliRunner().invoke(app, ["serve", "--ray", "-c", _spec_config(tmp_path, tiny),
                                   "--ray-address", "nonsense"])
    assert res.exit_code == 2, (res.output, res.exception)
    assert "error: --ray-address nonsense: cannot connect (Invalid address format: nonsense)" in res.output
    assert not ray.is_initialized() and signal.getsignal(signal.SIGTERM) == before


@pytest.mark.parametrize("started_here, deployed, calls", [
    (False, True, [("delete", "spec-plugins"), "ray.shutdown"]),  # a --ray-address cluster: Serve stays
    (True, True, [("delete", "spec-plugins"), "serve.shutdown", "ray.shutdown"]),
    (False, False, ["ray.shutdown"]),  # refused before deploying: nothing of the cluster's is deleted
])
def test_stopping_shuts_serve_down_only_on_a_ray_of_our_own(started_here, deployed, calls):
    seen: list = []
    fake_serve = SimpleNamespace(delete=lambda name: seen.append(("delete", name)),
                                 shutdown=lambda: seen.append("serve.shutdown"))
    fake_ray = SimpleNamespace(is_initialized=lambda: True, shutdown=lambda: seen.append("ray.shutdown"))
    server_cli._stop_serve(fake_serve, fake_ray, started_here, deployed)
    assert seen == calls


def test_ray_address_from_the_environment_is_joined_and_left_running(tmp_path, tiny, monkeypatch):
    """`ray job submit` sets RAY_ADDRESS for its entrypoint: without --ray-address the command joins
    that cluster (its proxy's port is not checked here; Serve is not shut down) rather than starting
    a second Ray on the node."""
    asked: list = []

    def spy(address=None, **kwargs):
        asked.append(address)
        raise ConnectionError("unreachable")

    monkeypatch.setattr(ray, "init", spy)
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.5:6379")
    with socket.socket() as busy:  # a port of this machine is not the cluster's proxy's: not checked
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        res = CliRunner().invoke(app, ["serve", "--ray", "-c", _spec_config(tmp_path, tiny), "--num-cpus", "0.5",
                                       "--port", str(busy.getsockname()[1])])
    assert asked == ["10.0.0.5:6379"], res.output
    assert "joining the Ray cluster in RAY_ADDRESS (10.0.0.5:6379), left running at stop" in res.output
    assert res.exit_code == 2 and res.output.rstrip().splitlines()[-1] == (
        "error: RAY_ADDRESS 10.0.0.5:6379: cannot connect (unreachable)"), res.output


def _fake_ray(seen: list, status, run_error: BaseException = KeyboardInterrupt()) -> tuple:
    """Ray's module and Serve as ``_run_on_ray`` calls them, recording the calls; ``serve.run`` raises
    ``run_error`` (a Ctrl-C by default, so a deploy that goes ahead stops at once)."""
    def run(app, name, route_prefix):
        seen.append("run")
        raise run_error

    fake_serve = SimpleNamespace(start=lambda http_options: seen.append("start"), status=lambda: status, run=run,
                                 delete=lambda name: seen.append(("delete", name)),
                                 shutdown=lambda: seen.append("serve.shutdown"))
    fake_ray = SimpleNamespace(init=lambda address, include_dashboard: seen.append(("init", address)),
                               is_initialized=lambda: True, shutdown=lambda: seen.append("ray.shutdown"))
    return fake_ray, fake_serve


def _serve_status(apps: dict):
    from ray.serve.schema import ApplicationStatusOverview, ServeStatus

    return ServeStatus(applications={name: ApplicationStatusOverview(status, "", 0.0, {})
                                     for name, status in apps.items()})


def test_an_app_of_our_name_on_the_cluster_is_refused_and_left(monkeypatch, capsys):
    """``serve.run`` would replace it (a `serve deploy` of a written config is named so) and the stop
    delete it: neither runs, and the error names the app."""
    from ray.serve import context
    from ray.serve.schema import ApplicationStatus

    monkeypatch.setattr(context, "_get_global_client",
                        lambda: SimpleNamespace(http_config=SimpleNamespace(host="127.0.0.1", port=8000)))
    seen: list = []
    fake_ray, fake_serve = _fake_ray(seen, _serve_status({"spec-plugins": ApplicationStatus.RUNNING}))
    with pytest.raises(typer.Exit):
        server_cli._run_on_ray(fake_ray, fake_serve, "head:6379", False, "127.0.0.1", 8000, None, "1 replica(s)")
    assert seen == [("init", "head:6379"), "start", "ray.shutdown"]
    assert capsys.readouterr().err.rstrip().splitlines()[-1] == (
        "error: Ray Serve on this cluster already has an application named 'spec-plugins' (status RUNNING), "
        "owned by another deployment: it is left as it is; remove it first (serve.delete('spec-plugins') from "
        "a Ray driver, or `serve shutdown` for all of Serve) to serve this one there")


def test_a_deploy_serve_refuses_is_not_called_a_replica_failure():
    """A route prefix another app holds: Serve refuses the deploy before any replica exists."""
    from ray.exceptions import RayTaskError
    from ray.serve.exceptions import RayServeException

    reason = 'Prefix / is being used by application "other". Failed to deploy application "spec-plugins".'
    refused = RayTaskError("ServeController.deploy_applications", "Traceback (most recent call last):\n"
                           f"ray.serve.exceptions.RayServeException: {reason}",
                           RayServeException(reason)).as_instanceof_cause()
    _, fake_serve = _fake_ray([], _serve_status({}), run_error=refused)
    with pytest.raises(server_cli._StartFailed) as failed:
        server_cli._deploy(fake_serve, None)
    assert str(failed.value) == f"Ray Serve refused to deploy 'spec-plugins': {reason}"


@pytest.mark.parametrize("started_here", [True, False])
def test_a_ray_without_the_private_proxy_api(started_here, monkeypatch, capsys):
    """Another Ray release without ``_get_global_client``: a Serve of our own Ray took our address, so
    it serves; on a joined cluster the running proxy's address cannot be checked, and that is the error."""
    from ray.serve import context

    monkeypatch.delattr(context, "_get_global_client")
    seen: list = []
    fake_ray, fake_serve = _fake_ray(seen, _serve_status({}))
    address = None if started_here else "head:6379"
    if started_here:  # then a Ctrl-C: our app deleted, Serve and Ray shut down
        server_cli._run_on_ray(fake_ray, fake_serve, address, True, "127.0.0.1", 8000, None, "1 replica(s)")
        assert seen == [("init", "local"), "start", "run", ("delete", "spec-plugins"), "serve.shutdown",
                        "ray.shutdown"]
        return
    with pytest.raises(typer.Exit):
        server_cli._run_on_ray(fake_ray, fake_serve, address, False, "127.0.0.1", 8000, None, "1 replica(s)")
    assert seen == [("init", "head:6379"), "start", "ray.shutdown"]
    assert capsys.readouterr().err.rstrip().splitlines()[-1].startswith(
        "error: --host 127.0.0.1 --port 8000: cannot tell whether the running Ray Serve proxy listens there "
        f"(Serve keeps the address it first started with): Ray {ray.__version__} has no "
        "ray.serve.context._get_global_client().http_config to read it from (")


def test_ray_errors_come_down_to_their_line():
    from ray.exceptions import RayTaskError
    from ray.serve._private.common import DeploymentStatus, DeploymentStatusTrigger
    from ray.serve.schema import ApplicationStatus, ApplicationStatusOverview, DeploymentStatusOverview, ServeStatus

    from spec_plugins.server.ray_serve import ray_error_text, replica_errors

    bind = RayTaskError("ProxyActor.ready", "Traceback (most recent call last):\n  File \"proxy.py\", line 1\n"
                        "RuntimeError: Failed to bind to address '127.0.0.1:1'.",
                        RuntimeError("Failed to bind to address '127.0.0.1:1'.")).as_instanceof_cause()
    assert ray_error_text(bind) == "Failed to bind to address '127.0.0.1:1'."
    message = ("The deployment failed to start 3 times in a row. See controller logs for details. Error:\n"
               "\x1b[36mray::ServeReplica:spec-plugins:spec-plugins.initialize_and_get_metadata()\x1b[39m\n"
               "RuntimeError: Traceback (most recent call last):\n  File \"setup.py\", line 31, in build_state\n"
               "    raise ValueError(...)\nValueError: --max-total-tokens 5000 exceeds the model's context of 1024")
    dep = DeploymentStatusOverview(DeploymentStatus.DEPLOY_FAILED, DeploymentStatusTrigger.REPLICA_STARTUP_FAILED,
                                   {}, message)
    status = ServeStatus(applications={"spec-plugins": ApplicationStatusOverview(
        ApplicationStatus.DEPLOY_FAILED, "Failed to update the deployments ['spec-plugins'].", 0.0,
        {"spec-plugins": dep})})
    assert replica_errors(status, "spec-plugins") == [
        "ValueError: --max-total-tokens 5000 exceeds the model's context of 1024"]
    assert replica_errors(status, "other") == []


@pytest.fixture(scope="module")
def cluster():
    """Another process's Ray with Serve on a port of its own and the app "other": (address, port)."""
    port = free_port()
    host = subprocess.Popen([sys.executable, "-c", HOST, str(port)], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=ENV)
    try:
        line = host.stdout.readline()
        assert line.startswith("GCS "), f"the cluster did not start: {line!r}"
        yield line.split()[1], port
    finally:
        host.send_signal(signal.SIGTERM)  # serve.shutdown and ray.shutdown, by its own process
        try:
            host.wait(120)
        except subprocess.TimeoutExpired:
            host.kill()
            host.wait()


def _cli(args: list[str], stop_after: str | None = None, before_stop=None, timeout: float = 300) -> tuple:
    """The command in a subprocess, SIGTERM once a stderr line contains ``stop_after``: (rc, out, err)."""
    proc = subprocess.Popen(CLI + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    lines, seen = [], threading.Event()

    def read() -> None:
        for line in proc.stderr:
            lines.append(line)
            if stop_after is not None and stop_after in line:
                seen.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        if stop_after is not None:
            assert seen.wait(timeout), "".join(lines[-30:])
            if before_stop is not None:
                before_stop()
            proc.send_signal(signal.SIGTERM)
        proc.wait(timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(30)
    return proc.returncode, proc.stdout.read(), "".join(lines)


def _other_app_and_ours(port: int) -> tuple[str, int]:
    """What "other" answers, and our /health's status once Serve's proxy has dropped a deleted route."""
    url = f"http://127.0.0.1:{port}"
    for _ in range(30):
        health = httpx.get(url + "/health", timeout=10).status_code
        if health == 404:
            break
        time.sleep(1.0)
    return httpx.get(url + "/other", timeout=10).text, health


def test_another_proxy_port_is_refused_naming_the_running_one(cluster, tmp_path, tiny):
    address, port = cluster
    asked = free_port()
    rc, _, err = _cli(["--ray-address", address, "-c", _spec_config(tmp_path, tiny), "--port", str(asked)],
                      timeout=120)
    assert rc == 2, err[-3000:]
    assert err.rstrip().splitlines()[-1] == (
        f"error: --host 127.0.0.1 --port {asked}: Ray Serve already runs on this cluster with its proxy on "
        f"127.0.0.1:{port} (fixed while Serve runs): give --host 127.0.0.1 --port {port}")
    assert _other_app_and_ours(port) == ("other app alive", 404)


def test_a_replica_that_cannot_build_is_named_and_removed(cluster, tmp_path, tiny):
    address, port = cluster
    rc, _, err = _cli(["--ray-address", address, "-c", _spec_config(tmp_path, tiny), "--port", str(port),
                       "--max-total-tokens", "5000"])
    assert rc == 2 and "Traceback" not in err.split("error:")[-1], err[-3000:]
    assert err.rstrip().splitlines()[-1] == ("error: the replicas of 'spec-plugins' failed to start: ValueError: "
                                             "--max-total-tokens 5000 exceeds the model's context of 1024")
    assert _other_app_and_ours(port) == ("other app alive", 404)


def test_sigterm_leaves_the_other_apps_of_the_cluster_running(cluster, tmp_path, tiny):
    address, port = cluster

    def ours_answers() -> None:
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=30).status_code == 200

    rc, out, err = _cli(["--ray-address", address, "-c", _spec_config(tmp_path, tiny), "--port", str(port)],
                        stop_after=f"serving on http://127.0.0.1:{port}", before_stop=ours_answers)
    assert rc == 0 and '{"stopped": true}' in out, err[-3000:]
    assert _other_app_and_ours(port) == ("other app alive", 404)


def test_sigterm_during_start_up_stops_cleanly(cluster, tmp_path, tiny):
    """SIGTERM while the replica is being added: our handler, not Ray's C++ one, so the app is deleted.
    The replica asks for 2 CPUs, which the cluster (2 CPUs, 0.1 held by "other") cannot place while
    "other" runs, so start-up lasts until the SIGTERM however fast a replica builds (--shutdown-timeout 0:
    Serve gives the unplaced replica 5 s to stop, not 35)."""
    address, port = cluster
    rc, out, err = _cli(["--ray-address", address, "-c", _spec_config(tmp_path, tiny), "--port", str(port),
                         "--num-cpus", "2", "--shutdown-timeout", "0"], stop_after="Adding 1 replica")
    assert "SIGTERM received" not in err and "serving on" not in err, err[-3000:]
    assert rc == 0 and '{"stopped": true}' in out, err[-3000:]
    assert _other_app_and_ours(port) == ("other app alive", 404)
