"""`python -m diprl.web [--runs runs/] [--port 8080] [--host 127.0.0.1] [--token ...]`: the local web app.

Serves every run directory under `--runs` (pages `/`, `/league`, `/games`, `/play`) until Ctrl-C. It
listens on 127.0.0.1 by default; any other address needs a token (`--token` or `DIPRL_WEB_TOKEN`), which
every request must then carry (open the printed address once: it sets a cookie). LLM seats of games played
in the browser start a local Ray and PolicyServer on first use. Exit status 2 for a bad option, a refused
address or a port in use.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from diprl.web.auth import TOKEN_ENV, TokenRequired

PROG = "python -m diprl.web"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[1] if __doc__ else None)
    parser.add_argument("--runs", type=Path, default=Path("runs"), help="directory holding run directories")
    parser.add_argument("--port", type=int, default=8080, help="port to listen on (0: a free one)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (not loopback: needs a token)")
    parser.add_argument("--token", default=None, help=f"token every request must carry (default: ${TOKEN_ENV})")
    parser.add_argument("--verbose", action="store_true", help="library logs at INFO")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    from diprl.console import quiet_libraries
    from diprl.web.server import serve

    args = parse_args(argv)
    if not 0 <= args.port <= 65535:
        print(f"{PROG}: error: --port must be between 0 and 65535, got {args.port}", file=sys.stderr)
        return 2
    quiet_libraries(args.verbose)

    def announce(url: str) -> None:
        print(f"diprl web: {url} (runs under {args.runs}; Ctrl-C stops it)", flush=True)

    try:
        serve(args.runs, args.host, args.port, args.token, announce)
    except (TokenRequired, OSError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
