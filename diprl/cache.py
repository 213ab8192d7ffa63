"""Where diprl keeps what it builds and what its local Ray needs: one root, never the user's home.

Tokenizers, tiny models, the local Ray's token and private home all live under one directory, so
`make clean` and CI caching deal with a single place.
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "DIPRL_CACHE_DIR"


def cache_root() -> Path:
    """`$DIPRL_CACHE_DIR`, else `<repo>/.cache` (git-ignored), else `~/.cache/diprl` when installed."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    repo = Path(__file__).resolve().parents[1]
    if (repo / "pyproject.toml").is_file():
        return repo / ".cache"
    return Path.home() / ".cache" / "diprl"
