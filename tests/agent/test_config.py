from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from agent.config import ConfigError, parse_run_args
from tests.agent.harness import REPO

BASE = ["--controller-url", "http://127.0.0.1:8000", "--node-name", "box-1"]


def test_flags_override_environment(tmp_path: Path) -> None:
    env = {
        "RACON_CONTROLLER_URL": "http://10.0.0.9:8000",
        "RACON_NODE_NAME": "from-env",
        "RACON_RPC_PORT": "6000",
        "RACON_STATE_DIR": str(tmp_path / "env-state"),
    }
    cfg = parse_run_args(["--node-name", "from-flag", "--rpc-port", "6001"], env)
    assert cfg.controller_url == "http://10.0.0.9:8000"
    assert cfg.node_name == "from-flag"
    assert cfg.rpc_port == 6001
    assert cfg.state_dir == tmp_path / "env-state"
    assert cfg.models_dir == tmp_path / "env-state" / "models"


def test_defaults_rpc_port_50052_metrics_off_and_rpc_worker_on(tmp_path: Path) -> None:
    cfg = parse_run_args([*BASE, "--state-dir", str(tmp_path)], {})
    assert cfg.rpc_port == 50052
    assert cfg.metrics_port is None
    assert cfg.rpc_worker is True
    assert cfg.drain_seconds == 10.0
    # Reaching a loopback controller picks the loopback address to advertise.
    assert cfg.advertise_address == "127.0.0.1"
    assert cfg.rpc_endpoint == "127.0.0.1:50052"


def test_environment_names_every_setting(tmp_path: Path) -> None:
    profile = tmp_path / "p.json"
    profile.write_text("{}")
    env = {
        "RACON_CONTROLLER_URL": "https://ctl.lan:8443/",
        "RACON_ENROLLMENT_TOKEN": "tok",
        "RACON_NODE_NAME": "n",
        "RACON_MODELS_DIR": str(tmp_path / "m"),
        "RACON_ADVERTISE_ADDRESS": "192.168.1.20",
        "RACON_RPC_PORT": "50060",
        "RACON_STATE_DIR": str(tmp_path / "s"),
        "RACON_HARDWARE_PROFILE": str(profile),
        "RACON_METRICS_PORT": "9109",
    }
    cfg = parse_run_args([], env)
    assert cfg.controller_url == "https://ctl.lan:8443"
    assert cfg.enrollment_token == "tok"
    assert cfg.models_dir == tmp_path / "m"
    assert cfg.advertise_address == "192.168.1.20"
    assert cfg.rpc_port == 50060
    assert cfg.hardware_profile == profile
    assert cfg.metrics_port == 9109


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--rpc-port", "70000"], "--rpc-port must be between 1 and 65535"),
        (["--rpc-port", "abc"], "--rpc-port must be a port number"),
        (["--controller-url", "ftp://x"], "--controller-url must be an http(s) URL"),
        (["--advertise-address", "not-an-ip"], "--advertise-address must be an IP address"),
        (["--node-name", "bad name!"], "--node-name must be"),
        (["--hardware-profile", "/nonexistent/p.json"], "is not a readable file"),
        (["--metrics-port", "50052"], "--metrics-port must differ"),
        (["--drain-seconds", "-1"], "--drain-seconds must be between"),
    ],
)
def test_bad_values_raise_one_clear_error(argv: list[str], needle: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        parse_run_args([*BASE, "--state-dir", str(tmp_path), *argv], {})
    assert needle in str(info.value)
    assert "\n" not in str(info.value)


def test_missing_controller_url_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--controller-url"):
        parse_run_args(["--state-dir", str(tmp_path)], {})


def test_a_restarted_agent_uses_its_stored_controller_url_and_ca(tmp_path: Path) -> None:
    """Issue 24: a joined agent restarted by hand needs neither --controller-url nor --ca-file."""
    import json

    from agent.client import controller_ca

    (tmp_path / "identity.json").write_text(
        json.dumps({"node_id": "n", "credential": "c", "controller_url": "https://10.0.0.5:8000",
                    "redis_url": "rediss://10.0.0.5:6380/0"})
    )  # fmt: skip
    config = parse_run_args(["--state-dir", str(tmp_path)], {})
    assert config.controller_url == "https://10.0.0.5:8000"
    pem = tmp_path / "given-ca.pem"
    pem.write_text("-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n")
    given = parse_run_args(["--state-dir", str(tmp_path), "--ca-file", str(pem)], {})
    kept = controller_ca(tmp_path, given.ca_file)
    assert kept == tmp_path / "controller-ca.pem" and kept.read_text() == pem.read_text()
    assert controller_ca(tmp_path, None) == kept  # the next start finds it without the flag
    with pytest.raises(ConfigError, match="no PEM certificate"):
        parse_run_args(
            ["--state-dir", str(tmp_path), "--ca-file", str(tmp_path / "identity.json")], {}
        )


def test_cli_exits_2_with_a_single_error_line_on_bad_config(tmp_path: Path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "agent.cli",
            "--foreground",
            *BASE,
            "--rpc-port",
            "0",
            "--state-dir",
            str(tmp_path),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert lines == ["node-agent: error: --rpc-port must be between 1 and 65535, got 0"]


@pytest.mark.parametrize("address", ["127.0.0.1", "169.254.10.1", "::1"])
def test_a_loopback_or_link_local_advertise_is_refused_for_a_remote_controller(
    address: str, tmp_path: Path
) -> None:
    with pytest.raises(ConfigError, match="on another machine"):
        parse_run_args(
            ["--controller-url", "https://10.0.0.5:8000", "--advertise-address", address,
             "--state-dir", str(tmp_path)],
            {},
        )  # fmt: skip
    # The controller's own machine may: make run's loopback node.
    ok = parse_run_args(
        ["--controller-url", "http://127.0.0.1:8000", "--advertise-address", address,
         "--state-dir", str(tmp_path)],
        {},
    )  # fmt: skip
    assert ok.advertise_address == address


@pytest.mark.parametrize(
    "name", ["RACON_STREAM_COALESCE_SECONDS", "RACON_STREAM_COALESCE_BUSY_SECONDS"]
)
@pytest.mark.parametrize("raw", ["abc", "-0.1", "2", "nan", "inf"])
def test_a_bad_stream_coalescing_window_is_refused_naming_it(
    name: str, raw: str, tmp_path: Path
) -> None:
    env = {name: raw}
    with pytest.raises(ConfigError, match=name) as exc:
        parse_run_args([*BASE, "--state-dir", str(tmp_path)], env)
    assert repr(raw) in str(exc.value)


@pytest.mark.parametrize(("raw", "seconds"), [("", 0.02), ("0", 0.0), ("0.05", 0.05), ("1", 1.0)])
def test_a_stream_coalescing_window_in_range_is_taken(raw: str, seconds: float) -> None:
    from agent.config import stream_coalesce_seconds

    assert stream_coalesce_seconds(raw) == seconds
    busy = "RACON_STREAM_COALESCE_BUSY_SECONDS"
    assert stream_coalesce_seconds(raw, name=busy) == (seconds if raw else 0.1)
