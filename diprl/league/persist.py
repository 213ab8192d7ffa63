"""The league's state on disk: atomic, checksummed, with the previous good copy kept.

A save writes `state.json.tmp`, fsyncs it, moves the current `state.json` to `state.prev.json`,
renames the temp file into place and fsyncs the directory. A crash at any point leaves either the
new state or the previous good one readable. A load verifies the format and a SHA-256 of the payload;
a corrupt or truncated `state.json` is reported (logged with the reason) and `state.prev.json` used;
if both are unreadable the load fails loudly instead of silently starting a fresh league.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

from diprl.atomic_io import fsync_dir

FORMAT = "diprl-league/1"
STATE_FILE = "state.json"
PREVIOUS_FILE = "state.prev.json"
_TMP_FILE = "state.json.tmp"

log = logging.getLogger(__name__)


class CorruptLeagueState(RuntimeError):
    """Neither the league state file nor its previous good copy can be read."""


def _digest(payload: str) -> str:
    return hashlib.sha256(payload.encode()).hexdigest()


def save_state(directory: Path, state: dict[str, Any]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    payload = json.dumps(state, sort_keys=True, separators=(",", ":"))
    blob = json.dumps({"format": FORMAT, "sha256": _digest(payload), "state": payload})
    tmp = directory / _TMP_FILE
    with tmp.open("w", encoding="utf-8") as fh:
        fh.write(blob)
        fh.flush()
        os.fsync(fh.fileno())
    current = directory / STATE_FILE
    if current.exists():
        os.replace(current, directory / PREVIOUS_FILE)
    os.replace(tmp, current)
    fsync_dir(directory)
    return current


def _read(path: Path) -> dict[str, Any]:
    try:
        blob = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"unreadable JSON ({exc})") from None
    except RecursionError:
        raise ValueError("unreadable JSON (nested too deeply to decode)") from None
    if not isinstance(blob, dict) or blob.get("format") != FORMAT:
        raise ValueError(f"not a {FORMAT} file")
    payload = blob.get("state")
    if not isinstance(payload, str) or _digest(payload) != blob.get("sha256"):
        raise ValueError("checksum mismatch (truncated or altered)")
    try:
        state = json.loads(payload)
    except (json.JSONDecodeError, RecursionError) as exc:  # a checksum made to match a forged payload
        why = "nested too deeply to decode" if isinstance(exc, RecursionError) else str(exc)
        raise ValueError(f"unreadable state ({why})") from None
    if not isinstance(state, dict):
        raise ValueError("state is not a mapping")
    return state


def load_state(directory: Path) -> dict[str, Any] | None:
    """The newest good state under `directory`, None when there is none yet (a fresh league)."""
    errors = []
    for name in (STATE_FILE, PREVIOUS_FILE):
        path = directory / name
        if not path.exists():
            continue
        try:
            state = _read(path)
        except ValueError as exc:
            log.error("league state %s is corrupt: %s; trying the previous good copy", path, exc)
            errors.append(f"{path}: {exc}")
            continue
        if errors:
            log.warning("league state restored from %s", path)
        return state
    if errors:
        raise CorruptLeagueState(
            "no readable league state: " + "; ".join(errors) + ". Move the directory aside to start a fresh league."
        )
    return None
