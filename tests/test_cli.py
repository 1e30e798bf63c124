import subprocess
import sys


def test_help_lists_every_subcommand_without_importing_heavy_libraries():
    code = (
        "import sys; from swarmd.cli.main import build_parser; build_parser().format_help(); "
        "print(','.join(m for m in ('tinygrad', 'libp2p') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_no_subcommand_prints_help_and_fails():
    done = subprocess.run([sys.executable, "-m", "swarmd"], capture_output=True, text=True)
    assert done.returncode == 2
    assert "usage: swarmd" in done.stderr


def test_a_daemons_log_keeps_libp2ps_real_errors_in_its_format_and_drops_its_routine_dial_failures():
    script = """
import logging
from swarmd.cli.join import setup_logging
setup_logging("info")
tcp = logging.getLogger("libp2p.transport.tcp")
tcp.error("Failed to open TCP stream: all attempts to connect to 127.0.0.1:1 failed")
tcp.error("the listener broke")
chatty = logging.getLogger("libp2p.network.auto_connector")
chatty.setLevel(logging.INFO)
chatty.info("initiating 197 new dials")
logging.getLogger("swarmd.swarm.service").info("member abcdef: alive (joined)")
"""
    err = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stderr
    lines = err.splitlines()
    assert len(lines) == 2, err
    assert lines[0].endswith("ERROR   libp2p.transport.tcp: the listener broke")
    assert lines[1].endswith("INFO    swarmd.swarm.service: member abcdef: alive (joined)")
