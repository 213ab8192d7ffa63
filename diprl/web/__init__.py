"""The local web app: watch runs, the league and games, and play a power against any PolicyRef.

`python -m diprl.web [--runs runs/] [--port 8080] [--host 127.0.0.1] [--token-file F]`, or beside a training
run: `start_web(runs_dir, host, port, token, client_factory=RunServerClients(run_dir / "adapters",
lambda: ServeClient(app_name=<the run's Serve app>)))`, whose handle has `.url`, `.login_url` and
`.stop()`. Pages: `/` (runs), `/league`, `/games`, `/play`; see `diprl.web.app`. Loopback by default; any
other address needs a token (`diprl.web.auth`).
"""

from diprl.web.clients import RunServerClients
from diprl.web.server import WebHandle, start_web

__all__ = ["RunServerClients", "WebHandle", "start_web"]
