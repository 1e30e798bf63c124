"""Writes docs/SETTINGS.md from the settings' declarations in swarmd/config.py (a test checks it is current).

    python scripts/settings_doc.py
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from swarmd.config import settings_markdown  # noqa: E402

if __name__ == "__main__":
    (ROOT / "docs" / "SETTINGS.md").write_text(settings_markdown())
    print("wrote docs/SETTINGS.md")
