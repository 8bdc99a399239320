"""The former name of tools/profile_nsa.py: time each stage of the NSA forward and backward.

Runs tools/profile_nsa.py with the same arguments (`--passes fwd` for the forward alone).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from profile_nsa import main  # noqa: E402,F401

if __name__ == "__main__":
    sys.exit(main())
