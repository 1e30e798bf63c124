"""Daemon settings: sizes, timing presets and the TOML file with `swarmd join`'s keys."""

from __future__ import annotations

import pytest

from swarmd.config import LAN, LOCAL_TEST, DaemonConfig, load_config_file, parse_size, parse_timings, warms_up
from swarmd.errors import UserError


def test_sizes_read_the_way_people_write_them():
    assert parse_size("12GiB") == 12 * 1024**3
    assert parse_size("8G") == 8 * 1000**3
    assert parse_size("512 MB") == 512 * 1000**2
    assert parse_size("1.5gib") == int(1.5 * 1024**3)
    assert parse_size(4096) == 4096
    with pytest.raises(UserError, match="cannot read 'lots'"):
        parse_size("lots")


def test_timings_come_from_a_preset_with_overrides():
    assert parse_timings("local-test") == LOCAL_TEST
    t = parse_timings({"preset": "lan", "heartbeat-interval": 0.5})
    assert t.heartbeat_interval == 0.5 and t.suspect_after == LAN.suspect_after
    with pytest.raises(UserError, match="unknown timings keys: beat"):
        parse_timings({"beat": 1})
    with pytest.raises(UserError, match="unknown timings preset 'wan'"):
        parse_timings("wan")


def test_a_config_file_uses_the_command_line_keys(tmp_path):
    path = tmp_path / "swarmd.toml"
    path.write_text('swarm = "lab"\nbootstrap = "/ip4/127.0.0.1/tcp/4001/p2p/x"\nmemory-limit = "12GiB"\n'
                    'device-label = "RTX 3060 12GB"\nlisten = ["/ip4/127.0.0.1/tcp/4001"]\nfull-reload = true\n'
                    'inline-step-ms = 20\n[timings]\npreset = "local-test"\nprobe-timeout = 0.7\n')
    changes = load_config_file(path)
    assert changes["swarm"] == "lab" and changes["bootstrap"] == ("/ip4/127.0.0.1/tcp/4001/p2p/x",)
    assert changes["memory_limit"] == 12 * 1024**3 and changes["device_label"] == "RTX 3060 12GB"
    assert changes["listen"] == ("/ip4/127.0.0.1/tcp/4001",) and changes["full_reload"] is True
    assert changes["inline_step_ms"] == 20.0
    assert changes["timings"].probe_timeout == 0.7 and changes["timings"].heartbeat_interval == 0.25


def test_config_file_mistakes_are_one_line_errors(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("swarm = \n")
    with pytest.raises(UserError, match="not valid TOML"):
        load_config_file(bad)
    bad.write_text("colour = 'blue'\n")
    with pytest.raises(UserError, match="unknown key 'colour'"):
        load_config_file(bad)
    with pytest.raises(UserError, match="does not exist"):
        load_config_file(tmp_path / "missing.toml")
    with pytest.raises(UserError, match="inline_step_ms must be 0"):
        DaemonConfig(inline_step_ms=-1)


def test_stages_capture_every_graph_first_on_gpus_unless_told_otherwise():
    assert warms_up(None, "CUDA") and warms_up(None, "CUDA:1") and warms_up(None, "METAL")
    assert not warms_up(None, "CPU")
    assert warms_up(True, "CPU") and not warms_up(False, "CUDA")


def test_a_plan_files_slot_and_the_cluster_settings_have_their_config_keys(tmp_path):
    path = tmp_path / "swarmd.toml"
    path.write_text('plan = "kimi.json"\nslot = "r0-4090-0"\nclaim-timeout = 30\ndata-plane-port = 7400\n'
                    'dial-map = ["127.0.0.1:4001=127.0.0.1:7001"]\nuplink-mbps = 100\n')
    config = DaemonConfig().with_overrides(**load_config_file(path))
    assert (config.slot, config.claim_timeout, config.data_plane_port) == ("r0-4090-0", 30.0, 7400)
    assert config.dial_map == ("127.0.0.1:4001=127.0.0.1:7001",) and config.uplink_mbps == 100.0
    with pytest.raises(UserError, match="data plane port 70000 is not a TCP port"):
        DaemonConfig(data_plane_port=70000)
