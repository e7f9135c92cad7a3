"""Hardening round 14: a Ray Serve config file's options are checked as the CLI checks them (a
replica with no body worker hung behind a healthy /health), /metrics writes every value exactly
(counters past 1e9 were rounded to 9 digits), and spec_acceptance_rate says what it divides by
(rows that drafted a depth, exported so a scrape can rebuild it)."""

from __future__ import annotations

import inspect

import pytest

from conftest import tiny_llama

pytest.importorskip("fastapi")

from spec_plugins.server.metrics import Metrics  # noqa: E402
from spec_plugins.server.ray_serve import ReplicaOptions, Scaling, app_from_args  # noqa: E402
from spec_plugins.stats import DecodeStats  # noqa: E402

CFG = {"target": {"backend": "torch", "model": "x"}}


# ---- ReplicaOptions: what `serve deploy` builds from a config file's args -------------------------
@pytest.mark.parametrize("field,value", [("cpu_workers", 0), ("body_timeout", 0.0), ("max_batch", 0),
                                         ("draft_policy", "bogus"), ("shutdown_timeout", -5),
                                         ("shutdown_timeout", float("inf")), ("max_total_tokens", 1),
                                         ("max_input_tokens", 0), ("threads", 0), ("max_batch", 2.5),
                                         ("max_batch", True), ("body_timeout", "30")])
def test_a_config_files_bad_option_is_refused_at_deploy_naming_it(field, value):
    with pytest.raises(ValueError) as err:
        app_from_args({"options": {"config": CFG, field: value}, "scaling": {}})  # before Ray is asked
    assert f"options.{field}" in str(err.value) and repr(value) in str(err.value), err.value


def test_max_input_tokens_must_stay_below_max_total_tokens():
    with pytest.raises(ValueError, match=r"max_input_tokens \(64\) must be < options.max_total_tokens \(64\)"):
        ReplicaOptions(CFG, max_input_tokens=64, max_total_tokens=64)


def test_the_least_values_the_cli_allows_are_accepted():
    opts = ReplicaOptions(CFG, max_batch=1, max_input_tokens=1, max_total_tokens=2, draft_policy="fixed",
                          shutdown_timeout=0, threads=1, body_timeout=0.001, cpu_workers=1)
    assert opts.cpu_workers == 1 and ReplicaOptions(CFG).max_batch == 8  # the defaults pass too


def test_option_bounds_are_the_cli_options_bounds():
    """One rule set: each bound equals the typer ``min`` of ``spec-plugins serve``'s option."""
    from spec_plugins.server.cli import serve
    from spec_plugins.server.ray_serve import OPTION_BOUNDS

    params = inspect.signature(serve).parameters
    shared = [name for name in OPTION_BOUNDS if name in params]
    assert set(shared) == set(OPTION_BOUNDS) - {"threads"}  # threads: derived from --num-cpus
    for name in shared:
        assert params[name].default.min == OPTION_BOUNDS[name][1], name


# ---- Scaling: a config file's `scaling` args -----------------------------------------------------
@pytest.mark.parametrize("field,value", [("replicas", 0), ("replicas", -1), ("replicas", 1.5), ("num_cpus", -1),
                                         ("num_gpus", -0.5), ("num_gpus", float("nan")),
                                         ("target_ongoing_requests", 0), ("max_ongoing_requests", 0),
                                         ("max_ongoing_requests", True)])
def test_a_config_files_bad_scaling_is_refused_at_deploy_naming_it(field, value):
    with pytest.raises(ValueError) as err:
        app_from_args({"options": {"config": CFG}, "scaling": {field: value}})  # before Ray is asked
    assert f"scaling.{field}" in str(err.value) and repr(value) in str(err.value), err.value


@pytest.mark.parametrize("pair", [[3, 1], [0, 0], [-1, 2], [1], [1.0, 2], [True, 2], "1:4"])
def test_a_config_files_bad_autoscale_range_is_refused_naming_it(pair):
    with pytest.raises(ValueError, match=r"scaling\.autoscale"):
        app_from_args({"options": {"config": CFG}, "scaling": {"autoscale": pair}})


def test_the_autoscale_rule_is_the_clis():
    from spec_plugins.server.ray_serve import parse_autoscale

    with pytest.raises(ValueError, match=r"--autoscale '3:1': need 0 <= MIN <= MAX"):
        parse_autoscale("3:1")
    with pytest.raises(ValueError, match=r"scaling.autoscale \[3, 1\]: need 0 <= MIN <= MAX"):
        Scaling(autoscale=(3, 1))


def test_the_least_scaling_values_the_cli_allows_are_accepted():
    sc = Scaling(replicas=1, num_cpus=0, num_gpus=0.0, target_ongoing_requests=0.5, max_ongoing_requests=1)
    assert sc.deployment_options()["num_replicas"] == 1
    assert Scaling(autoscale=(0, 1)).deployment_options()["autoscaling_config"]["max_replicas"] == 1
    assert Scaling().replicas == 1  # the defaults pass too


def test_scaling_bounds_are_the_cli_options_bounds():
    from spec_plugins.server.cli import serve
    from spec_plugins.server.ray_serve import SCALING_BOUNDS

    params = inspect.signature(serve).parameters
    shared = [name for name in SCALING_BOUNDS if name in params]
    assert set(shared) == {"replicas", "num_cpus", "num_gpus"}  # the rest are not serve options
    for name in shared:
        assert params[name].default.min == SCALING_BOUNDS[name][1], name


def test_server_state_refuses_no_body_workers():
    """``CapacityLimiter(0)``: every request would wait forever for a worker thread."""
    from spec_plugins.backends.torch_runtime import TorchRuntime
    from spec_plugins.decoder import SpeculativeDecoder
    from spec_plugins.server.setup import build_state
    from spec_plugins.verifiers import ExactVerifier
    from test_server import tiny_tokenizer

    tok = tiny_tokenizer()
    dec = SpeculativeDecoder(TorchRuntime(tiny_llama(seed=3), tok), None, ExactVerifier(), tokenizer=tok)
    with pytest.raises(ValueError, match="cpu_workers must be an integer >= 1, got 0"):
        build_state(dec, 2, 48, 128, "fixed", model_id="tiny", cpu_workers=0)
    assert build_state(dec, 2, 48, 128, "fixed", model_id="tiny", cpu_workers=1).cpu_limiter.total_tokens == 1


# ---- /metrics values -----------------------------------------------------------------------------
def _samples(text: str) -> dict[str, str]:
    """``name{labels}`` -> the value as written (each sample line is ``series value``)."""
    return dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))


def _render() -> tuple[str, DecodeStats]:
    m = Metrics()
    m.request_done("generate", 200, 0.3, generated=1_000_000_007, first_token=0.1)
    s = DecodeStats(target_forwards=123_456_789_012, new_tokens=2**53 + 1)
    s.emitted_tokens, s.row_rounds = 1, 3  # mean_accepted_tokens 1/3: no short decimal
    return m.render(s, None, [("spec_test_inf", "gauge", "An infinite value.", float("inf"))]), s


def test_metrics_write_large_counters_and_floats_exactly():
    text, s = _render()
    got = _samples(text)
    assert got["spec_generated_tokens_total"] == "1000000007"
    assert got["spec_target_forwards_total"] == "123456789012"
    assert int(got["spec_decoded_tokens_total"]) == 2**53 + 1  # past what a float holds
    assert float(got["spec_mean_accepted_tokens"]) == s.mean_accepted_tokens == 1 / 3
    assert got["spec_test_inf"] == "+Inf"


def test_metrics_text_parses_with_prometheus_client():
    parser = pytest.importorskip("prometheus_client.parser", reason="prometheus_client is not installed")
    text, s = _render()
    values = {smp.name: smp.value for fam in parser.text_string_to_metric_families(text) for smp in fam.samples}
    assert values["spec_generated_tokens_total"] == 1_000_000_007
    assert values["spec_target_forwards_total"] == 123_456_789_012
    assert values["spec_mean_accepted_tokens"] == 1 / 3
    assert values["spec_test_inf"] == float("inf")


# ---- spec_acceptance_rate -------------------------------------------------------------------------
def test_acceptance_rate_is_rebuilt_from_the_exported_rows_by_position():
    s = DecodeStats()
    for _ in range(10):
        s.observe_round([4, 2], 1, 2)  # a tree: 4 nodes at depth 0, its path accepted 1 deep
    for _ in range(10):
        s.observe_round([1, 1], 0, 1)  # a chain rejected at its first token
    text = Metrics().render(s)
    got = _samples(text)
    for d, want in enumerate([10 / 20, 0 / 20]):  # by hand: rows reaching depth d / rows drafting it
        acc = int(got[f'spec_accepted_by_position_total{{position="{d}"}}'])
        rows = int(got[f'spec_rows_by_position_total{{position="{d}"}}'])
        assert float(got[f'spec_acceptance_rate{{position="{d}"}}']) == acc / rows == want
    assert int(got['spec_drafted_by_position_total{position="0"}']) == 50  # accepted / drafted would be 0.2
    help_ = next(line for line in text.splitlines() if line.startswith("# HELP spec_acceptance_rate "))
    assert "spec_rows_by_position_total" in help_ and "Accepted / drafted" not in help_
