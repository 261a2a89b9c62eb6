"""The `p2pfl-node` command line.

Every mistake a person can make (bad YAML, missing file, unknown peer, wrong
key) prints one line naming the file, the field and the fix, and exits 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from collections.abc import Callable, Collection, Sequence
from pathlib import Path

import yaml

from node.check_files import check_status_token, check_tls
from p2pfl.config import (
    ConfigError,
    SiteConfig,
    check_config_files,
    config_schema,
    dump_config,
    load_config,
    protocol_names,
)
from p2pfl.config.secagg_guarantees import secagg_guarantee_lines
from p2pfl.config.secagg_ring import secagg_ring_problem
from p2pfl.errors import UserError
from p2pfl.secure.identity import (
    ADDRESS_PLACEHOLDER,
    Card,
    IdentityError,
    LocalIdentity,
    Roster,
    load_card,
)

log = logging.getLogger("p2pfl-node")

SUBCOMMANDS = (
    "run",
    "check",
    "schema",
    "keygen",
    "provision",
    "partition",
    "genbuffer",
    "evaluate",
    "roster",
    "relay",
)


def _user_error(message: str) -> int:
    print(f"p2pfl-node: {message}", file=sys.stderr)
    return 2


# ----------------------------------------------------------------------------- check / schema


def load_site(path: Path) -> tuple[SiteConfig, Roster, LocalIdentity]:
    """Config + roster + keys, cross-checked; raises UserError."""
    cfg = load_config(path, check_files=False)
    if not cfg.federation.roster.exists():
        raise ConfigError(
            path,
            "federation.roster",
            f"file not found: {cfg.federation.roster}",
            "create it with `p2pfl-node provision` or `p2pfl-node roster add`",
        )
    roster = Roster.load(cfg.federation.roster)
    if cfg.node.name not in roster:
        raise ConfigError(
            path,
            "node.name",
            f"site {cfg.node.name!r} is not in the roster {cfg.federation.roster}",
            "add its card with `p2pfl-node roster add`",
        )
    # a secure sum has at most the roster's other sites as contributors
    ring = secagg_ring_problem(cfg.protocol, len(roster.names()) - 1)
    if ring is not None:
        raise ConfigError(path, *ring)
    check_config_files(cfg, path)
    identity = LocalIdentity.load(cfg.node.name, cfg.signing_key_path, cfg.agreement_key_path)
    listed, ours = roster[cfg.node.name].card, identity.card()
    for key, key_path in (
        ("signing_key", cfg.signing_key_path),
        ("agreement_key", cfg.agreement_key_path),
    ):
        if getattr(ours, key) != getattr(listed, key):
            raise ConfigError(
                path,
                f"identity.{key}",
                f"key {key_path} does not match the roster's public key for {cfg.node.name!r}",
                f"point identity.{key} at this site's own key or update the roster card",
            )
    return cfg, roster, identity


def cmd_check(args: argparse.Namespace) -> int:
    from p2pfl.learning.dp_recipe import recipe_settings  # torch: this command only
    from p2pfl.learning.site_model import check_dp, check_model_name
    from protocols.selection import neighbour_count

    cfg, roster, _ = load_site(Path(args.config))
    check_tls(cfg, Path(args.config))
    check_status_token(cfg, Path(args.config))
    check_model_name(cfg, Path(args.config))
    check_dp(cfg, Path(args.config))
    print(dump_config(cfg), end="")
    recipe = recipe_settings(cfg.training)
    if recipe is not None:
        print("# training recipe in effect: " + "; ".join(f"{k}: {v}" for k, v in recipe.items()))
    sites = len(roster.names())
    wanted = neighbour_count(getattr(cfg.protocol, "fraction", 1.0), sites - 1)
    for line in secagg_guarantee_lines(cfg.protocol, sites, wanted):
        print(line)
    print(
        f"# ok: {cfg.node.name} in federation {cfg.federation.id!r} with {len(roster.names())} sites: {', '.join(roster.names())}"
    )
    return 0


def cmd_schema(args: argparse.Namespace) -> int:
    print(json.dumps(config_schema(), indent=2))
    return 0


# ----------------------------------------------------------------------------- keys and federation


def cmd_keygen(args: argparse.Namespace) -> int:
    if args.rotate:
        from node.deploy import run_rotate

        return run_rotate(args)
    out = Path(args.out)
    sign_path = out / f"{args.name}.sign.pem"
    if sign_path.exists() and not args.force:
        return _user_error(
            f"{sign_path}: key already exists — keep it, or pass --force to replace it (peers will need the new card)"
        )
    identity = LocalIdentity.generate(args.name)
    sign_path, kex_path = identity.save(out)
    card = identity.card(args.address or ADDRESS_PLACEHOLDER)
    text = yaml.safe_dump(card.to_dict(), sort_keys=False)
    (out / f"{args.name}.card.yaml").write_text(text)
    print(f"# private keys (mode 0600, never share): {sign_path} {kex_path}", file=sys.stderr)
    print(f"# fingerprint (read it to each peer by phone): {card.fingerprint()}", file=sys.stderr)
    print(
        f"# public card, also in {out / (args.name + '.card.yaml')} — send it to the other sites:",
        file=sys.stderr,
    )
    print(text, end="")
    return 0


def cmd_provision(args: argparse.Namespace) -> int:
    from node.provision import provision

    names = [s.strip() for s in args.sites.split(",") if s.strip()]
    if len(names) < 2 or len(set(names)) != len(names):
        return _user_error(
            f"--sites {args.sites!r}: give at least two distinct comma-separated names, e.g. --sites a,b,c"
        )
    if args.protocol not in protocol_names():
        return _user_error(
            f"--protocol {args.protocol!r}: unknown — use one of {', '.join(protocol_names())}"
        )
    out = Path(args.out)
    if args.site_data:
        site_data = Path(args.site_data).resolve()
        sources = [str(site_data / f"site_{i}.npz") for i in range(len(names))]
        missing = [s for s in sources if not Path(s).exists()]
        if missing:
            return _user_error(
                f"--site-data {args.site_data}: {missing[0]} not found — run `p2pfl-node partition --sites {len(names)}` first"
            )
    else:
        sources = [args.data if args.data == "digits" else str(Path(args.data).resolve())] * len(
            names
        )
    relays = [s.strip() for s in (args.relay or "").split(",") if s.strip()]
    behind = [s.strip() for s in (args.behind or "").split(",") if s.strip()]
    if args.compose and relays:
        return _user_error("--compose with --relay: the compose file has no relay service yet")
    ports = [args.base_port + i for i in range(len(names))]
    status_ports = [args.status_base_port + i for i in range(len(names))]
    try:
        plans = provision(
            out,
            names,
            protocol={"name": args.protocol, "rounds": args.rounds},
            data_sources=sources,
            ports=ports,
            status_ports=status_ports,
            federation=args.federation,
            seed=args.seed,
            relays=relays,
            behind=behind,
            # the relays' ports follow the sites'
            relay_ports=[args.base_port + len(names) + i for i in range(len(relays))],
            relay_status_ports=[args.status_base_port + len(names) + i for i in range(len(relays))],
        )
    except ValueError as exc:
        return _user_error(f"--relay/--behind: {exc}")
    if args.compose:
        from node.deploy import write_compose

        print(
            f"compose file (one container per site): {write_compose(out, names, ports, status_ports)}"
        )
    from node.resources import available_cores, threads_per_site

    print(f"provisioned {len(names)} sites in {out}: roster {out / 'roster.yaml'}")
    print(
        f"training.threads: {threads_per_site(len(names))} per site "
        f"({len(names)} sites on this machine's {available_cores()} cores)"
    )
    # the token in the URL only for a terminal: provisioning from a script or CI
    # writes its stdout to logs others read (a second review)
    terminal = sys.stdout.isatty()
    for plan in plans:
        print(
            f"  {plan.name}: p2pfl-node --config {plan.config_path}   (peer port {plan.port}, "
            f"dashboard {plan.dashboard_url(with_token=terminal)}, token in {plan.token_file})"
        )
    for relay in plans.relays:
        print(
            f"  {relay.name} (relay): p2pfl-node relay --config {relay.config_path}   "
            f"(port {relay.port}, status port {relay.status_port}, token in {relay.token_file})"
        )
    if behind:
        print(f"  outbound-only (reached through {', '.join(relays)}): {', '.join(behind)}")
    return 0


def cmd_roster(args: argparse.Namespace) -> int:
    path = Path(args.roster)
    roster = Roster.load(path) if path.exists() else Roster([], path)
    cards = {c.name: c for c in roster.cards()}
    if args.roster_command == "add":
        card = load_card(Path(args.card))
        if card.address == ADDRESS_PLACEHOLDER:
            return _user_error(
                f"{args.card}: address is still {ADDRESS_PLACEHOLDER} — ask the site for its reachable HOST:PORT and edit the card"
            )
        # max_samples is the admin's word, not the site's: --max-samples sets it, a
        # re-added card (a rotated key) keeps the one the roster had, and the card's
        # own is dropped (outside the fingerprint, it was kept: a cap of 1 written
        # into the card in transit silenced the site's model, a key review).
        previous = cards.get(card.name)
        if args.max_samples is not None:
            if args.max_samples < 1:
                return _user_error(f"--max-samples must be >= 1, got {args.max_samples}")
            card = dataclasses.replace(card, max_samples=args.max_samples)
        else:
            kept = previous.max_samples if previous is not None else None
            card = dataclasses.replace(card, max_samples=kept)
        card, problem = _previous_key_checked(card, previous)
        if problem:
            return _user_error(f"{args.card}: {problem}")
        cards[card.name] = card
        Roster(list(cards.values()), path, relays=roster.relays).save(path)
        cap = f", max_samples {card.max_samples}" if card.max_samples is not None else ""
        print(
            f"{path}: {card.name} added ({len(cards)} sites{cap}); send SIGHUP to running nodes to reload"
        )
        print(f"  fingerprint {card.fingerprint()}: confirm it with {card.name} by phone")
    elif args.roster_command == "remove":
        if args.name not in cards:
            return _user_error(
                f"{path}: no site named {args.name!r} — known: {', '.join(sorted(cards)) or '(none)'}"
            )
        del cards[args.name]
        Roster(list(cards.values()), path, relays=roster.relays).save(path)
        print(
            f"{path}: {args.name} removed ({len(cards)} sites); send SIGHUP to running nodes to reload"
        )
    else:
        for card in roster.cards():
            cap = f"\tmax_samples={card.max_samples}" if card.max_samples is not None else ""
            where = card.address if card.address else "via " + ",".join(card.via)
            print(f"{card.name}\t{where}\t{card.fingerprint()}{cap}")
    return 0


def _previous_key_checked(card: Card, listed: Card | None) -> tuple[Card, str | None]:
    """A rotated card's `previous_signing_key` lets that key sign for the site
    until `previous_valid_until`, so it must be a key this roster already
    trusts for the site (its current or previous key); else a card swapped in
    transit, with the real new key but the attacker's as the previous one,
    let the attacker sign as the site for the whole grace period (a key
    review). A site the roster does not list yet gets no grace key at all.
    The key the roster already holds as previous keeps its deadline or an
    earlier one: a card that named it again with a later deadline revived a
    rotated-out (maybe stolen) key, and the fingerprint does not cover it."""
    if not card.previous_signing_key:
        return card, None
    none = {"previous_signing_key": None, "previous_valid_until": None, "grace_signature": None}
    if listed is None:
        return dataclasses.replace(card, **none), None
    if card.previous_signing_key == listed.signing_key:  # a fresh rotation
        if card.grace_signed():
            return card, None
        if card.grace_signature is None:  # an older keygen --rotate wrote none (a third review)
            return card, (
                "the card has no grace_signature: a p2pfl-node older than the signed grace "
                "period wrote it, or it was altered in transit — confirm its fingerprint by "
                f"phone, then `roster remove {card.name}` and add the card again (no grace period)"
            )
        return card, (
            "the grace period (previous_signing_key, previous_valid_until) is not signed by the "
            "card's signing key: it was altered in transit, or made by hand — ask the site to "
            "send the card `keygen --rotate` wrote"
        )
    if card.previous_signing_key == listed.previous_signing_key:  # the same rotation again
        until = min(card.previous_valid_until or 0.0, listed.previous_valid_until or 0.0)
        if until == card.previous_valid_until:
            return card, None
        return dataclasses.replace(card, previous_valid_until=until, grace_signature=None), None
    return card, (
        f"previous_signing_key is not a key the roster lists for {card.name!r}: the card was "
        "altered, or the site rotated twice — confirm its fingerprint by phone, then "
        f"`roster remove {card.name}` and add the card again (no grace period)"
    )


# ----------------------------------------------------------------------------- run


def cmd_run(args: argparse.Namespace) -> int:
    cfg, roster, identity = load_site(Path(args.config))
    from node.daemon import run_node
    from p2pfl.learning.site_model import check_dp

    check_dp(cfg, Path(args.config))  # the same refusal as `check`, before anything starts

    return run_node(cfg, roster, identity, config_path=Path(args.config))


def cmd_relay(args: argparse.Namespace) -> int:
    """A relay for outbound-only sites (issue 31): runs until SIGINT or SIGTERM."""
    from node.relay_status import serve_relay
    from p2pfl.config import load_relay_config

    path = Path(args.config)
    return serve_relay(load_relay_config(path), path, args.log_level)


# ----------------------------------------------------------------------------- parser


def build_parser(*, optional: bool | Collection[str] = True) -> argparse.ArgumentParser:
    """The CLI. The sub-commands that live with their feature (OPTIONAL_HELP)
    import torch when they register their arguments, about 3 CPU-seconds:
    `optional=True` registers them all; a collection of names registers those,
    and lists the others by name and help only (what `main` does: only the
    command being run pays its imports); `optional=False` leaves them out (a
    relay, issue 31)."""
    parser = argparse.ArgumentParser(
        prog="p2pfl-node", description="Decentralized federated-learning node."
    )
    parser.add_argument(
        "--log-level", default=None, help="override logging.level (DEBUG, INFO, ...)"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("run", help="run the daemon (the default)")
    p.add_argument("--config", required=True, help="site.yaml")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser(
        "check", help="validate site.yaml, roster and keys; print the resolved config"
    )
    p.add_argument("--config", required=True)
    p.set_defaults(func=cmd_check)

    p = sub.add_parser("schema", help="print the JSON Schema of site.yaml")
    p.set_defaults(func=cmd_schema)

    p = sub.add_parser("keygen", help="create this site's private keys and print its public card")
    p.add_argument("--name", required=True)
    p.add_argument("--out", required=True, help="directory for the keys (e.g. state/keys)")
    p.add_argument("--address", default=None, help="HOST:PORT peers reach this site at")
    p.add_argument("--force", action="store_true", help="replace existing keys")
    p.add_argument(
        "--rotate",
        action="store_true",
        help="replace the signing key, keep the old one valid for --grace-hours (new card printed)",
    )
    p.add_argument("--grace-hours", type=float, default=24.0, help="with --rotate (default 24)")
    p.set_defaults(func=cmd_keygen)

    p = sub.add_parser("provision", help="keys + roster + site.yaml for a local federation")
    p.add_argument("--sites", required=True, help="comma-separated site names, e.g. a,b,c")
    p.add_argument("--out", required=True)
    p.add_argument("--base-port", type=int, default=7000)
    p.add_argument("--status-base-port", type=int, default=8000)
    p.add_argument("--federation", default="local")
    p.add_argument("--protocol", default="fedavgp2p")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument(
        "--data",
        default="digits",
        help="'digits', an .npz or an ImageFolder directory (same for all sites)",
    )
    p.add_argument(
        "--site-data",
        default=None,
        help="directory of site_<i>.npz files from `p2pfl-node partition`",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--compose",
        action="store_true",
        help="also write DIR/compose.yaml (one container per site)",
    )
    p.add_argument(
        "--relay",
        default=None,
        help="comma-separated relay names, e.g. r1: DIR/r1/relay.yaml each (wire.encryption on)",
    )
    p.add_argument(
        "--behind",
        default=None,
        help="comma-separated outbound-only sites (address null, via every --relay)",
    )
    p.set_defaults(func=cmd_provision)

    p = sub.add_parser("roster", help="edit the roster: add a public card, remove a site, list")
    rsub = p.add_subparsers(dest="roster_command", required=True)
    q = rsub.add_parser("add")
    q.add_argument("card")
    q.add_argument("--roster", required=True)
    q.add_argument(
        "--max-samples",
        type=int,
        default=None,
        help="the most training samples this site may claim (caps its weight in every mean; "
        "default: keep the roster's, if any)",
    )
    q = rsub.add_parser("remove")
    q.add_argument("name")
    q.add_argument("--roster", required=True)
    q = rsub.add_parser("list")
    q.add_argument("--roster", required=True)
    p.set_defaults(func=cmd_roster)

    p = sub.add_parser(
        "relay", help="run a relay for sites that accept no inbound connection (relay.yaml)"
    )
    p.add_argument("--config", required=True, help="relay.yaml")
    p.set_defaults(func=cmd_relay)

    if optional is True:
        optional = OPTIONAL_HELP
    for name, register in _optional_commands().items() if optional is not False else ():
        if name not in optional:  # listed in the help; never run (main registers the one it runs)
            sub.add_parser(name, help=OPTIONAL_HELP[name])
            continue
        try:
            register(sub, name)
        except ImportError as exc:  # feature not installed in this build
            log.debug("sub-command %s unavailable: %s", name, exc)
    return parser


OPTIONAL_HELP = {
    "partition": "split a data set into per-site sets (+ class-distribution PNG)",
    "genbuffer": "privacy-preserving GAN: train it, sample synthetic buffers, audit privacy",
    "evaluate": "cross-site / ensemble evaluation of node models",
    "export": "this site's model as a package + model card",
    "predict": "run an exported model on images (PNG, DICOM, npz)",
}


def _optional_commands() -> dict[str, Callable[[argparse._SubParsersAction, str], None]]:
    """Sub-commands that live with their feature: each registers itself, importing it."""

    def partition(sub: argparse._SubParsersAction, name: str) -> None:
        from p2pfl.learning.data.partition import add_partition_arguments, run_partition

        p = sub.add_parser(name, help=OPTIONAL_HELP[name])
        add_partition_arguments(p)
        p.set_defaults(func=run_partition)

    def genbuffer(sub: argparse._SubParsersAction, name: str) -> None:
        from genbuffer.cli import add_genbuffer_parser, run_genbuffer

        add_genbuffer_parser(sub, OPTIONAL_HELP[name])
        sub.choices[name].set_defaults(func=run_genbuffer)

    def evaluate(sub: argparse._SubParsersAction, name: str) -> None:
        from node.evaluate import add_evaluate_arguments, run_evaluate

        p = sub.add_parser(name, help=OPTIONAL_HELP[name])
        add_evaluate_arguments(p)
        p.set_defaults(func=run_evaluate)

    def export(sub: argparse._SubParsersAction, name: str) -> None:
        from node.export import add_export_arguments, run_export

        p = sub.add_parser(name, help=OPTIONAL_HELP[name])
        add_export_arguments(p)
        p.set_defaults(func=run_export)

    def predict(sub: argparse._SubParsersAction, name: str) -> None:
        from node.predict import add_predict_arguments, run_predict

        p = sub.add_parser(name, help=OPTIONAL_HELP[name])
        add_predict_arguments(p)
        p.set_defaults(func=run_predict)

    return {
        "partition": partition,
        "genbuffer": genbuffer,
        "evaluate": evaluate,
        "export": export,
        "predict": predict,
    }


def _command_of(argv: list[str]) -> str | None:
    """The sub-command argv names, read without building the whole parser: only
    that command's module is imported (the optional sub-commands' import torch:
    ~3 s of `p2pfl-node keygen`, `provision` or a relay's start-up, issue 31)."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--log-level")
    pre.add_argument("command", nargs="?")
    return pre.parse_known_args(argv)[0].command


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0].startswith("--config"):
        argv = ["run", *argv]
    command = _command_of(argv)
    parser = build_parser(optional=False if command == "relay" else {command} & set(OPTIONAL_HELP))
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help(sys.stderr)
        return 2
    logging.basicConfig(
        level=args.log_level or "INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        return int(args.func(args) or 0)
    except (UserError, ConfigError, IdentityError) as exc:
        return _user_error(str(exc))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
