"""The local web app: watch runs, the league and games, and play a power against any PolicyRef.

`python -m diprl.web [--runs runs/] [--port 8080] [--host 127.0.0.1] [--token ...]`, or `start_web(...)`
beside a training run. Pages: `/` (runs), `/league`, `/games`, `/play`; see `diprl.web.app`. Loopback by
default; any other address needs a token (`diprl.web.auth`).
"""

from diprl.web.server import WebHandle, start_web

__all__ = ["WebHandle", "start_web"]
