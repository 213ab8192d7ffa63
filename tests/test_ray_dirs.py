"""The local Ray's directories are private to the user who started it (issue 38, N12)."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

HEAD = """
import json, os
import ray
from diprl.raysession import ray_session
with ray_session(address="local", num_cpus=1) as info:
    node = ray._private.worker._global_node
    session = node.get_session_dir_path()
    dirs = {"root": node.get_temp_dir_path(), "session": session, "logs": node.get_logs_dir_path(),
            "sockets": node.get_sockets_dir_path()}
    for top, names, _ in os.walk(session):
        for name in names:
            dirs.setdefault(os.path.join(top, name), os.path.join(top, name))
    print(json.dumps({key: os.stat(path).st_mode for key, path in dirs.items()}))
"""


def test_the_local_rays_temp_session_and_log_directories_are_private() -> None:
    """Found by review (N12): Ray makes its temp root, session and log directories mode 0777 without the
    sticky bit, so any local account could replace a socket or a log. They are 0700 once the head is up."""
    # A short root of its own: Ray's socket paths under it must stay below the 108 bytes AF_UNIX allows.
    root = Path(tempfile.mkdtemp(prefix="dr-", dir="/tmp"))
    try:
        env = dict(os.environ, RAY_TMPDIR=str(root / "ray"), PYTHONPATH=str(REPO))
        env.pop("RAY_ADDRESS", None)
        result = subprocess.run(
            [sys.executable, "-c", HEAD], cwd=REPO, env=env, capture_output=True, text=True, timeout=180
        )
        assert result.returncode == 0, result.stderr[-3000:]
        modes = json.loads(result.stdout.strip().splitlines()[-1])
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for key in ("root", "session", "logs", "sockets"):
        assert stat.S_IMODE(modes[key]) == 0o700, (key, oct(modes[key]))
    shared = {path: oct(mode) for path, mode in modes.items() if mode & 0o022}
    assert not shared, f"directories others may write to: {shared}"
