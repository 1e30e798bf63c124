"""Daemon settings: sizes, timing presets, and each setting declared once as the option of `swarmd join`, the key
of its TOML file and the row of docs/SETTINGS.md."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from pathlib import Path

import pytest

from swarmd.cli import join
from swarmd.config import (
    LAN,
    LOCAL_TEST,
    DaemonConfig,
    config_changes,
    load_config_file,
    parse_size,
    parse_timings,
    setting,
    settings,
    settings_markdown,
    warms_up,
)
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
    assert changes["timings"].probe_timeout == 0.7
    assert changes["timings"].heartbeat_interval == LOCAL_TEST.heartbeat_interval != LAN.heartbeat_interval


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
    with pytest.raises(UserError, match="data-plane port 70000 is not a TCP port"):
        DaemonConfig(data_plane_port=70000)

# --- each setting declared once ------------------------------------------------------------------------------


def join_parser() -> argparse.ArgumentParser:
    sub = argparse.ArgumentParser(prog="swarmd").add_subparsers(dest="command")
    join.register(sub)
    return sub.choices["join"]


def joined(*argv: str) -> DaemonConfig:
    return join.build_config(join_parser().parse_args(list(argv)))


def test_every_setting_is_an_option_of_join_with_its_help_and_a_key_of_the_config_file():
    options = {a.dest: a for a in join_parser()._actions}
    for s in settings():
        assert options[s.name].option_strings[0] == s.option and options[s.name].help == s.how.help
        assert s.name in config_changes({s.key: _example(s)})
    assert [s.name for s in settings()] == [f.name for f in fields(DaemonConfig)]


def _example(s):
    return {bool: True, int: 3, float: 2.5, tuple: ["x"]}.get(s.kind, "local-test" if s.name == "timings" else
                                                              "1GiB" if s.how.parse is parse_size else
                                                              (s.how.choices or ["text"])[0])


def test_the_command_line_reads_each_kind_of_setting_as_the_config_file_does(tmp_path):
    argv = ["--listen", "/ip4/127.0.0.1/tcp/1", "--listen", "/ip4/127.0.0.1/tcp/2", "--memory-limit", "2GiB",
            "--max-requests", "2", "--inline-step-ms", "7.5", "--no-warmup", "--standby", "--home", "~/sw",
            "--allow-peer", "a", "--timings", "local-test", "--wire-dtype", "float16", "--api-max-request-bytes", "1MiB"]
    toml = {"listen": ["/ip4/127.0.0.1/tcp/1", "/ip4/127.0.0.1/tcp/2"], "memory-limit": "2GiB", "max-requests": 2,
            "inline-step-ms": 7.5, "warmup": False, "standby": True, "home": "~/sw", "allow-peers": "a",
            "timings": "local-test", "wire-dtype": "float16", "api_max_request_bytes": "1MiB"}
    from_cli = joined(*argv)
    assert from_cli == DaemonConfig().with_overrides(**config_changes(toml))
    assert from_cli.home == Path("~/sw").expanduser() and from_cli.memory_limit == 2 * 1024**3
    assert from_cli.warmup is False and from_cli.allow_peers == ("a",) and from_cli.timings == LOCAL_TEST


def test_the_command_line_beats_the_environment_which_beats_the_config_file(tmp_path, monkeypatch):
    path = tmp_path / "swarmd.toml"
    path.write_text('bootstrap = "/from/file"\nswarm = "file"\napi-token = "from-the-file-0123456789"\n')
    monkeypatch.setenv("SWARMD_BOOTSTRAP", "/env/a, /env/b  /env/c")
    monkeypatch.setenv("SWARMD_API_TOKEN", "  from-the-environment-0123  ")
    config = joined("--config", str(path), "--swarm", "cli", "-q")
    assert config.bootstrap == ("/env/a", "/env/b", "/env/c") and config.swarm == "cli"
    assert config.api_token == "from-the-environment-0123" and config.log_level == "warning"
    assert joined("--config", str(path), "--bootstrap", "/cli").bootstrap == ("/cli",)
    monkeypatch.delenv("SWARMD_BOOTSTRAP")
    assert joined("--config", str(path)).bootstrap == ("/from/file",)


def test_a_config_value_of_the_wrong_kind_is_a_one_line_error():
    with pytest.raises(UserError, match="'max-context' must be a whole number, not 'lots'"):
        config_changes({"max-context": "lots"})
    with pytest.raises(UserError, match="'mdns' must be true or false"):
        config_changes({"mdns": "yes"})
    with pytest.raises(UserError, match="'listen' must be a string or a list of strings"):
        config_changes({"listen": 4001})
    with pytest.raises(UserError, match="log level 'loud' is not one of"):
        DaemonConfig(log_level="loud")


def test_a_new_setting_is_one_field_with_its_default_and_help():
    @dataclass(frozen=True)
    class WithAKnob(DaemonConfig):
        knob_size: int | None = setting(None, "how big the knob is", metavar="SIZE", parse=parse_size)

    (knob,) = [s for s in settings(WithAKnob) if s.name == "knob_size"]
    assert (knob.option, knob.key, knob.optional, knob.how.help) == ("--knob-size", "knob-size", True, "how big the knob is")
    assert knob.convert("2KiB", "--knob-size") == 2048

    @dataclass(frozen=True)
    class Undeclared(DaemonConfig):
        knob: int = 3

    with pytest.raises(TypeError, match=r"Undeclared\.knob is not declared with setting"):
        settings(Undeclared)


def test_docs_settings_md_is_the_table_the_declarations_make():
    doc = Path(__file__).resolve().parents[2] / "docs" / "SETTINGS.md"
    assert doc.read_text() == settings_markdown(), "docs/SETTINGS.md is stale: run `python scripts/settings_doc.py`"
