"""`python -m diprl.web [--runs runs/] [--port 8080] [--host 127.0.0.1] [--token-file F]`: the local web app.

Serves every run directory under `--runs` (pages `/`, `/league`, `/games`, `/play`) until Ctrl-C. It
listens on 127.0.0.1 by default; any other address needs a token (the first line of `--token-file`, or
`DIPRL_WEB_TOKEN`), which every request must then carry (open the printed address once with `?token=<the
token>`: it sets a cookie). The token is never a command-line word (every account sees those in `ps`) and
never printed: the start-up line says where it is. `--certfile` and `--keyfile` serve HTTPS; otherwise
put a TLS proxy in front of an address other machines reach (docs/security.md). LLM seats of games played
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
    parser.add_argument(
        "--token-file", type=Path, default=None, help=f"file whose first line is the token (default: ${TOKEN_ENV})"
    )
    parser.add_argument("--token", default=None, help=argparse.SUPPRESS)  # refused: see main
    parser.add_argument("--certfile", type=Path, default=None, help="PEM certificate chain: serve HTTPS")
    parser.add_argument("--keyfile", type=Path, default=None, help="PEM private key of --certfile")
    parser.add_argument("--verbose", action="store_true", help="library logs at INFO")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    from diprl.console import quiet_libraries
    from diprl.web.server import Tls, serve

    args = parse_args(argv)
    if not 0 <= args.port <= 65535:
        print(f"{PROG}: error: --port must be between 0 and 65535, got {args.port}", file=sys.stderr)
        return 2
    if args.token is not None:
        print(
            f"{PROG}: error: --token would show the token to every account on this machine (ps); put it in a "
            f"file (mode 0600) and give --token-file, or set {TOKEN_ENV}",
            file=sys.stderr,
        )
        return 2
    if (args.certfile is None) != (args.keyfile is None):
        print(f"{PROG}: error: --certfile and --keyfile go together", file=sys.stderr)
        return 2
    tls = Tls(args.certfile, args.keyfile) if args.certfile is not None else None
    quiet_libraries(args.verbose)

    def announce(url: str, token_at: str | None) -> None:
        login = f"; {token_at}: open {url}?token=<token> once" if token_at else ""
        print(f"diprl web: {url} (runs under {args.runs}{login}; Ctrl-C stops it)", flush=True)

    try:
        serve(args.runs, args.host, args.port, args.token_file, announce, tls)
    except (TokenRequired, OSError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
