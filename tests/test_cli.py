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
