"""Start or join Ray in one place: loopback only, token authentication on, nothing tried off this machine.

Every entry point, benchmark and test goes through `connect` (or the `ray_session` context manager),
because each of these was a real leak when commands started Ray themselves:

- Ray reads `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER` once, when `ray` is imported; setting it later does
  nothing and the node binds the machine's routable address. With the switch on, `ray.init` even maps
  `_node_ip_address="127.0.0.1"` to the routable address. A local head is therefore started with the
  switch off for the call, `_node_ip_address` and `dashboard_host` at 127.0.0.1, and its processes
  inherit the switch off, whatever the environment says.
- Ray 2.60 turns token authentication on by default for a local head. We keep it on (without it the
  job API runs code for every local account) and keep its token out of the user's home: it lives in
  the diprl cache (`RAY_AUTH_TOKEN_PATH`), created once with mode 0600.
- Every head starts a dashboard process, even with `include_dashboard=False`, whose usage-stats
  module asks the AWS/Azure/GCP metadata services who hosts it (169.254.169.254,
  metadata.google.internal) whenever `~/ray_bootstrap_config.yaml` is missing, whatever
  `RAY_USAGE_STATS_ENABLED` says. The head's processes are started with `HOME` pointing at a private
  directory that holds that file as `{}`, so the check finds nothing to ask about; the user's own home
  is left untouched (the driver's `HOME` is restored once the head is up).
- vLLM's GPU worker posts usage statistics unless `VLLM_NO_USAGE_STATS`/`DO_NOT_TRACK` are set.
- Ray makes its temp root (`$RAY_TMPDIR`, else `$TMPDIR/ray`), each session's directory and its
  `logs`, `sockets` and `runtime_resources` mode 0777 without the sticky bit ("so others can use
  it"), so any local account could swap a socket, a log or a runtime environment. A local head is
  started with that chmod switched off, and the root and every directory of the session are made
  0700 once the head is up (`_private_directories`).

Joining an existing cluster (`RAY_ADDRESS`, e.g. inside `ray job submit` on a `ray up` cluster) starts
nothing and changes none of that cluster's settings.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import stat
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diprl.cache import cache_root

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"

# Set before `ray` or `vllm` is imported (and inherited by every process Ray starts). `setdefault`
# semantics: a value the user exported wins, except where loopback-only depends on it (see connect).
PRIVACY_ENV: Mapping[str, str] = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # read at import: keep a local head on loopback
    "RAY_USAGE_STATS_ENABLED": "0",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}


def ray_dir() -> Path:
    """The private directory of the local Ray: its token and the HOME its processes see."""
    return cache_root() / "ray"


def token_path() -> Path:
    """The token file of the local Ray (created on first use, mode 0600)."""
    return ray_dir() / "auth_token"


def _ensure_token(path: Path) -> None:
    if path.is_file() and path.read_text().strip():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
        f.flush()
        os.fsync(f.fileno())


def private_home() -> Path:
    """A HOME for the local head's processes whose `ray_bootstrap_config.yaml` is `{}` (see the module doc)."""
    home = ray_dir() / "home"
    home.mkdir(parents=True, exist_ok=True)
    bootstrap = home / "ray_bootstrap_config.yaml"
    if not bootstrap.is_file() or bootstrap.read_text().strip() != "{}":
        bootstrap.write_text("{}\n")
    return home


def prepare_environment() -> None:
    """The environment every diprl process needs before importing Ray or vLLM (idempotent).

    Also points Ray at our token file unless the user named a token (`RAY_AUTH_TOKEN` or
    `RAY_AUTH_TOKEN_PATH`) themselves.
    """
    for key, value in PRIVACY_ENV.items():
        os.environ.setdefault(key, value)
    if not os.environ.get("RAY_AUTH_TOKEN") and not os.environ.get("RAY_AUTH_TOKEN_PATH"):
        path = token_path()
        _ensure_token(path)
        os.environ["RAY_AUTH_TOKEN_PATH"] = str(path)


@dataclass(frozen=True)
class RayInfo:
    """What a command tells its user about the Ray it runs on."""

    local: bool  # True: this process started a loopback head; False: joined `address`
    address: str
    dashboard_url: str | None
    token_path: str | None

    def dashboard_hint(self) -> str | None:
        """The line that tells a user how to open the dashboard (None without one)."""
        if not self.dashboard_url:
            return None
        url = self.dashboard_url if "://" in self.dashboard_url else f"http://{self.dashboard_url}"
        if not self.token_path:
            return f"Ray dashboard: {url}"
        return f"Ray dashboard: {url} (token authentication: paste the token in {self.token_path} when it asks)"


@contextlib.contextmanager
def _environment(values: Mapping[str, str]) -> Iterator[None]:
    """`values` in os.environ for the block (the processes started in it inherit them), then restored."""
    old = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in old.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def _loopback_constant() -> Iterator[None]:
    """Ray's import-time cluster switch, off while a local head starts.

    With it on (the variable was 1 when this process imported Ray), `ray.init` maps
    `_node_ip_address="127.0.0.1"` to the machine's routable address: the pin alone does not hold.
    """
    from ray._private import ray_constants

    old = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = old


@contextlib.contextmanager
def _directories_not_shared() -> Iterator[None]:
    """Ray's "make this directory shared" (a chmod to 0777) switched off while a local head starts."""
    from ray._common import utils

    old = utils.try_make_directory_shared
    utils.try_make_directory_shared = lambda directory_path: None
    try:
        yield
    finally:
        utils.try_make_directory_shared = old


PRIVATE_DIR_MODE = 0o700


def _make_private(path: Path) -> None:
    """`path` (a real directory this user owns) mode 0700; another account's, or a symlink, is left alone."""
    try:
        st = path.lstat()
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) != PRIVATE_DIR_MODE:
            os.chmod(path, PRIVATE_DIR_MODE, follow_symlinks=False)
    except OSError as exc:
        log.warning("could not make %s private to this user: %s", path, exc.strerror)


def _private_directories() -> None:
    """The local head's temp root and every directory of its session, private to this user (0700)."""
    import ray

    node = getattr(ray._private.worker, "_global_node", None)
    if node is None:
        return
    _make_private(Path(node.get_temp_dir_path()))
    session = Path(node.get_session_dir_path())
    _make_private(session)
    for top, names, _ in os.walk(session):
        for name in names:
            _make_private(Path(top, name))


def _temp_root(init_options: Mapping[str, Any]) -> Path:
    """Where a new local head will put its sessions (Ray's own rule)."""
    from ray._common.utils import get_default_ray_temp_dir

    return Path(init_options.get("_temp_dir") or get_default_ray_temp_dir())


def connect(
    *,
    num_cpus: int | None = None,
    dashboard: bool = False,
    namespace: str | None = None,
    address: str | None = None,
    **init_options: Any,
) -> RayInfo:
    """Join the cluster at `address` (default `$RAY_ADDRESS`), or start a loopback-only local head.

    `init_options` go to `ray.init` (logging, `_system_config`, resources...); the address options are
    ours and cannot be overridden. Call `ray.shutdown()` (or use `ray_session`) to stop a local head.
    """
    prepare_environment()
    import ray

    for key in ("_node_ip_address", "dashboard_host", "address"):
        if key in init_options:
            raise ValueError(f"connect() decides {key}: loopback for a local head, $RAY_ADDRESS to join")
    target = address if address is not None else os.environ.get("RAY_ADDRESS")
    if target and target != "local":
        context = ray.init(address=target, namespace=namespace, **init_options)
        url = getattr(context, "dashboard_url", None) or None
        return RayInfo(local=False, address=target, dashboard_url=url, token_path=None)
    if os.environ.get("RAY_AUTH_MODE", "").lower() == "disabled":
        warnings.warn(
            "RAY_AUTH_MODE=disabled: this Ray's job API runs code for every account on this machine; "
            "unset it to keep token authentication on",
            stacklevel=2,
        )
    # Ray enables token authentication itself for a new local head (and refreshes its own cached
    # config, which setting RAY_AUTH_MODE here would not) and then warns how to opt out: not advice we
    # want printed in every run.
    logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
    # The head's processes (and every worker the raylet starts later) inherit this environment: a
    # private HOME, and the cluster switch off so that a worker's own idea of its address is loopback.
    root = _temp_root(init_options)
    with contextlib.suppress(FileExistsError):
        root.mkdir(mode=PRIVATE_DIR_MODE, parents=True)
    _make_private(root)
    with (
        _environment({"HOME": str(private_home()), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}),
        _loopback_constant(),
        _directories_not_shared(),
    ):
        context = ray.init(
            address="local",
            num_cpus=num_cpus,
            namespace=namespace,
            include_dashboard=dashboard,
            dashboard_host=LOOPBACK,
            _node_ip_address=LOOPBACK,
            **init_options,
        )
    _private_directories()
    url = getattr(context, "dashboard_url", None) or None
    node_address = str(getattr(context, "address_info", {}).get("gcs_address", ""))
    token = os.environ.get("RAY_AUTH_TOKEN_PATH") or None
    return RayInfo(local=True, address=node_address, dashboard_url=url if dashboard else None, token_path=token)


@contextlib.contextmanager
def ray_session(**kwargs: Any) -> Iterator[RayInfo]:
    """`connect(**kwargs)` for the length of a `with` block; Ray is shut down after it, however it ends."""
    import ray

    info = connect(**kwargs)
    try:
        yield info
    finally:
        ray.shutdown()
