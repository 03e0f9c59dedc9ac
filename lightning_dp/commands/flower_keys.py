"""``lightning-dp flower-keys``: the TLS certificates and SuperNode keys of a secure Flower deployment.

Each party makes its own secrets (lightning_dp.flower.keys):

    lightning-dp flower-keys --out keys/ --server-host <server>      # the server's operator: CA + SuperLink's TLS
    lightning-dp flower-keys --out keys/ --site <site>                # each site, on its own machine: its key pair

The first writes ca.pem (to every site and to whoever runs flwr), superlink.pem and superlink.key (the SuperLink's
machine) and ca.key (keep it offline); the second writes <site>/node.key (stays on the site) and
<site>/node.key.pub (sent to the operator, who registers it with flwr supernode register). Both in one call
(--server-host and --site, repeated) for a trial on one machine. Nothing is overwritten. The commands that use them:
docs/federated.md, "A consortium's deployment".
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    from lightning_dp.commands.errors import ShortArgumentParser

    head, body = __doc__.split("\n\n", 1)
    parser = ShortArgumentParser(prog="lightning-dp flower-keys", description=head,
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=body.strip())
    parser.add_argument("--out", required=True, help="the folder to write to (created; nothing in it is overwritten)")
    parser.add_argument("--server-host", action="append", default=[], metavar="HOST",
                        help="a name or IP address the sites and flwr reach the SuperLink at (repeat for several): "
                             "makes the CA and the SuperLink's certificate")
    parser.add_argument("--site", action="append", default=[], metavar="NAME",
                        help="a site's name (repeat for several): makes its SuperNode key pair in <out>/<NAME>/")
    parser.add_argument("--days", type=int, default=365, help="validity of the certificates in days (default 365)")
    parser.add_argument("--name", default="lightning-dp", help="the consortium's name in the certificates")
    return parser


def main(argv: Sequence[str]) -> int:
    """Entry point of ``lightning-dp flower-keys``; returns the exit code (2 for bad input)."""
    parser = build_parser()
    args = parser.parse_args(list(argv))
    if not args.server_host and not args.site:
        parser.error("nothing to make: give --server-host HOST (the CA and the SuperLink's certificate) and/or "
                     "--site NAME (a site's key pair)")
    if len(set(args.site)) != len(args.site):
        parser.error(f"--site {args.site}: a site is named twice")
    from lightning_dp.flower.keys import write_server, write_site

    written = []
    try:
        if args.server_host:
            written += write_server(args.out, args.server_host, days=args.days, name=args.name)
        for site in args.site:
            written += write_site(args.out, site)
    except ValueError as err:
        parser.error(str(err))
    for path in written:
        secret = path.suffix == ".key"
        print(f"wrote {path}{'  (secret: stays on this machine)' if secret else ''}")
    return 0
