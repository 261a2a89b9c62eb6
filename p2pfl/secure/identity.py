"""Site identity (Ed25519 signing + X25519 key agreement) and the federation roster.

A site's private keys are PEM files (PKCS#8, mode 0600) that never leave it.
What it shares is its public card: name, address and both public keys as
base64 of the raw 32 bytes. The roster is the list of cards: the allow-list of
who may talk to whom. A roster entry may carry a previous signing key with a
grace deadline, so keys rotate without downtime, and `max_samples`: the most
training samples the federation admin lets that site claim (its weight in a
weighted mean is capped there, whatever count it sends; absent = no cap).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import math
import os
import re
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

from p2pfl.errors import UserError
from p2pfl.files import PUBLIC_FILE, atomic_write_bytes, atomic_write_text

ADDRESS_PLACEHOLDER = "HOST:PORT"
# What `node.name` and `relay.name` may be (p2pfl/config: the same pattern): a
# roster name outside it is no site or relay that can run, and a control
# character in it rewrote what `roster add` printed (a key review).
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
# An address (HOST:PORT, [IPv6]:PORT): printable ASCII, no space. It is not in
# the fingerprint, and `roster list` prints it before the fingerprint: a tab and
# an escape sequence in it showed a made-up fingerprint and hid the real one
# (a second key review).
ADDRESS_PATTERN = r"[\x21-\x7e]{1,300}"


class IdentityError(UserError):
    """Missing, unreadable or malformed key, card or roster."""


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


def _unb64(text: str, what: str, where: str) -> bytes:
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError, TypeError):
        raise IdentityError(
            f"{where}: {what} is not valid base64 — copy it again from the site's public card"
        ) from None
    if len(raw) != 32:
        raise IdentityError(
            f"{where}: {what} must be 32 bytes, got {len(raw)} — copy it again from the site's public card"
        )
    return raw


@dataclass(frozen=True)
class Card:
    """A site's public identity, as exchanged between institutions."""

    name: str
    address: str | None  # None: an outbound-only site, reached through `via`
    signing_key: str  # base64 raw Ed25519 public key
    agreement_key: str  # base64 raw X25519 public key
    previous_signing_key: str | None = None
    previous_valid_until: float | None = None  # unix seconds
    max_samples: int | None = None  # the admin's cap on this site's claimed sample count
    # Relays (roster `relays:` names) an outbound-only site keeps a connection to;
    # its messages are sent through one of them (node/relay_wire.py, issue 31).
    via: tuple[str, ...] = ()
    # The new signing key's signature over the grace key and its deadline
    # (`grace_message`): the fingerprint, confirmed by phone, covers the new
    # key, and through this signature the deadline a rotated card sets.
    grace_signature: str | None = None

    def grace_signed(self) -> bool:
        """Whether `grace_signature` is this card's signing key's over its
        previous key and deadline (False without either)."""
        if not self.previous_signing_key or self.grace_signature is None:
            return False
        try:
            signature = base64.b64decode(self.grace_signature, validate=True)
            key = Ed25519PublicKey.from_public_bytes(
                _unb64(self.signing_key, "signing_key", self.name)
            )
            key.verify(signature, grace_message(self))
        except (binascii.Error, ValueError, TypeError, InvalidSignature, IdentityError):
            return False
        return True

    def fingerprint(self) -> str:
        """What two sites compare by a second channel (a phone call) before one
        adds the other's card: SHA-256 over the name and both public keys, 32
        hex digits in groups of 4. Comparing the signing key alone missed a
        card swapped in transit with the attacker's agreement key, to which
        every encrypted payload was then readable (a key review)."""
        digest = hashlib.sha256(b"p2pfl-card-v1\0" + self.name.encode("utf-8") + b"\0")
        digest.update(_unb64(self.signing_key, "signing_key", self.name))
        digest.update(_unb64(self.agreement_key, "agreement_key", self.name))
        hexed = digest.hexdigest()[:32]
        return " ".join(hexed[i : i + 4] for i in range(0, 32, 4))

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name,
            "address": self.address,
            "signing_key": self.signing_key,
            "agreement_key": self.agreement_key,
        }
        if self.previous_signing_key:
            out["previous_signing_key"] = self.previous_signing_key
            out["previous_valid_until"] = self.previous_valid_until
        if self.max_samples is not None:
            out["max_samples"] = self.max_samples
        if self.via:
            out["via"] = list(self.via)
        if self.previous_signing_key and self.grace_signature:
            out["grace_signature"] = self.grace_signature
        return out

    @classmethod
    def from_dict(cls, data: Any, where: str) -> Card:
        if not isinstance(data, dict):
            raise IdentityError(
                f"{where}: a site entry must be a mapping with name, address, signing_key, agreement_key"
            )
        missing = [k for k in ("name", "address", "signing_key", "agreement_key") if k not in data]
        if missing:
            raise IdentityError(
                f"{where}: missing {', '.join(missing)} — copy the site's public card (p2pfl-node keygen prints it)"
            )
        if not isinstance(data["name"], str) or not re.fullmatch(NAME_PATTERN, data["name"]):
            raise IdentityError(
                f"{where}: name {str(data['name'])[:80]!r} is not a site name (letters, digits, "
                "'_', '.', '-', at most 64, as node.name) — check the card came from the site"
            )
        unknown = set(data) - {
            "name",
            "address",
            "signing_key",
            "agreement_key",
            "previous_signing_key",
            "previous_valid_until",
            "max_samples",
            "via",
            "grace_signature",
        }
        if unknown:
            raise IdentityError(f"{where}: unknown keys {sorted(unknown)} — remove them")
        card = cls(
            name=str(data["name"]),
            address=_address(data["address"], f"{where} ({data['name']})"),
            signing_key=str(data["signing_key"]),
            agreement_key=str(data["agreement_key"]),
            previous_signing_key=data.get("previous_signing_key"),
            previous_valid_until=_valid_until(
                data.get("previous_valid_until"), f"{where} ({data['name']})"
            ),
            max_samples=_max_samples(data.get("max_samples"), f"{where} ({data['name']})"),
            via=_via(data.get("via"), f"{where} ({data['name']})"),
            grace_signature=_optional_str(data.get("grace_signature"), "grace_signature", where),
        )
        if card.address is None and not card.via:
            raise IdentityError(
                f"{where} ({card.name}): address is null but no relay is named — give the site's "
                "HOST:PORT, or `via: [RELAY, ...]` for a site that accepts no inbound connection"
            )
        _unb64(card.signing_key, "signing_key", f"{where} ({card.name})")
        _unb64(card.agreement_key, "agreement_key", f"{where} ({card.name})")
        if card.previous_signing_key:
            _unb64(card.previous_signing_key, "previous_signing_key", f"{where} ({card.name})")
        return card


def grace_message(card: Card) -> bytes:
    """What a rotated card's new signing key signs: its name, grace key and deadline."""
    until = repr(float(card.previous_valid_until or 0.0))
    return f"p2pfl-grace-v1\0{card.name}\0{card.previous_signing_key}\0{until}".encode()


def _optional_str(value: Any, what: str, where: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise IdentityError(f"{where}: {what} must be text (base64), got {value!r}")


def _address(value: Any, where: str) -> str | None:
    """A card's `address`: HOST:PORT, or null for an outbound-only site."""
    if value is None:
        return None
    if not isinstance(value, str) or not re.fullmatch(ADDRESS_PATTERN, value):
        raise IdentityError(f"{where}: address must be HOST:PORT or null, got {value!r}")
    return value


def _via(value: Any, where: str) -> tuple[str, ...]:
    """A card's optional `via`: the distinct names of the relays it connects to."""
    if value is None:
        return ()
    if (
        not isinstance(value, list)
        or not all(isinstance(v, str) and v for v in value)
        or len(set(value)) != len(value)
    ):
        raise IdentityError(
            f"{where}: via must be a list of distinct relay names (the roster's `relays:`), "
            f"got {value!r}"
        )
    return tuple(value)


def _relays(raw: Any, where: str) -> dict[str, str]:
    """The roster's optional `relays:` list of {name, address}."""
    if raw is None:
        return {}
    if not isinstance(raw, list):
        raise IdentityError(f"{where}: relays must be a list of {{name, address}} entries")
    out: dict[str, str] = {}
    for i, entry in enumerate(raw):
        if (
            not isinstance(entry, dict)
            or set(entry) != {"name", "address"}
            or not isinstance(entry["name"], str)
            or not re.fullmatch(NAME_PATTERN, entry["name"])
            or not isinstance(entry["address"], str)
            or not re.fullmatch(ADDRESS_PATTERN, entry["address"])
        ):
            raise IdentityError(
                f"{where}: relays[{i}] must be a mapping with exactly a name and an address "
                f"(HOST:PORT), got {entry!r}"
            )
        if entry["name"] in out:
            raise IdentityError(f"{where}: relay {entry['name']!r} listed twice — keep one entry")
        out[entry["name"]] = entry["address"]
    return out


def _valid_until(value: Any, where: str) -> float | None:
    """A card's optional `previous_valid_until`: unix seconds, a finite number.
    Anything else used to load and then break every signature check of the
    site: a string (an ISO date) raised TypeError at each message, and `.nan`
    or `.inf` kept the previous key valid for ever (a key review)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise IdentityError(
            f"{where}: previous_valid_until must be unix seconds (a finite number, as "
            f"`p2pfl-node keygen --rotate` writes it), got {value!r} — copy the rotated card again"
        )
    return float(value)


def _max_samples(value: Any, where: str) -> int | None:
    """A card's optional `max_samples`: a positive whole number of samples."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise IdentityError(
            f"{where}: max_samples must be a whole number >= 1 (the most training samples "
            f"this site may claim), got {value!r} — fix it or remove the line"
        )
    return value


@dataclass
class LocalIdentity:
    """This site's private keys."""

    name: str
    signing: Ed25519PrivateKey
    agreement: X25519PrivateKey

    @property
    def signing_public(self) -> bytes:
        return self.signing.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )

    @property
    def agreement_public(self) -> bytes:
        return self.agreement.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )

    def card(self, address: str = ADDRESS_PLACEHOLDER) -> Card:
        return Card(self.name, address, b64(self.signing_public), b64(self.agreement_public))

    def sign(self, data: bytes) -> bytes:
        return self.signing.sign(data)

    def shared_secret(self, peer_agreement_public: X25519PublicKey) -> bytes:
        return self.agreement.exchange(peer_agreement_public)

    @classmethod
    def generate(cls, name: str) -> LocalIdentity:
        return cls(name, Ed25519PrivateKey.generate(), X25519PrivateKey.generate())

    def save(self, out_dir: Path) -> tuple[Path, Path]:
        pem = serialization.PrivateFormat.PKCS8
        none = serialization.NoEncryption()
        sign_path = out_dir / f"{self.name}.sign.pem"
        kex_path = out_dir / f"{self.name}.kex.pem"
        # Private keys: mode 0600 from the moment the file exists.
        atomic_write_bytes(
            sign_path, self.signing.private_bytes(serialization.Encoding.PEM, pem, none), mode=0o600
        )
        atomic_write_bytes(
            kex_path,
            self.agreement.private_bytes(serialization.Encoding.PEM, pem, none),
            mode=0o600,
        )
        return sign_path, kex_path

    @classmethod
    def load(cls, name: str, signing_path: Path, agreement_path: Path) -> LocalIdentity:
        signing = _load_private(signing_path, Ed25519PrivateKey, "Ed25519 signing")
        agreement = _load_private(agreement_path, X25519PrivateKey, "X25519 agreement")
        return cls(name, signing, agreement)  # type: ignore[arg-type]


def key_file_problem(info: os.stat_result) -> str | None:
    """Why a private key file with this (followed) stat may be known or
    replaced by another account, or None. Others may neither read nor write
    it, its group may not write it, and it belongs to this account or root.
    Group read and a link stay allowed: a Kubernetes Secret volume
    (deploy/k8s) is links to root-owned files, mode 0440 for the pod's fsGroup."""
    mode = stat.S_IMODE(info.st_mode)
    if not stat.S_ISREG(info.st_mode):
        return "is not a plain file"
    if mode & 0o027:
        return f"has mode {mode:04o}: other accounts may read or replace it"
    if hasattr(os, "getuid") and info.st_uid not in (os.getuid(), 0):
        return f"belongs to uid {info.st_uid}, not to this account or root"
    return None


def _load_private(path: Path, kind: type, what: str) -> Any:
    try:
        # O_NONBLOCK: a FIFO planted at the name is refused, not waited on
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as fh:
            problem = key_file_problem(os.fstat(fh.fileno()))
            if problem is not None:
                raise IdentityError(
                    f"{path}: the {what} key {problem} — `chmod 600` it as the node's own "
                    "user, or create a new key with `p2pfl-node keygen` if it may be known"
                )
            data = fh.read()
    except FileNotFoundError:
        raise IdentityError(
            f"{path}: {what} key not found — create it with `p2pfl-node keygen`"
        ) from None
    except OSError as exc:
        raise IdentityError(
            f"{path}: cannot read {what} key ({exc.strerror}) — check its owner and mode 0600"
        ) from None
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError):
        raise IdentityError(
            f"{path}: not a PEM private key — regenerate it with `p2pfl-node keygen`"
        ) from None
    if not isinstance(key, kind):
        raise IdentityError(
            f"{path}: holds a {type(key).__name__}, expected an {what} key — check identity.* in site.yaml"
        )
    return key


@dataclass
class RosterSite:
    """A roster entry with its keys parsed."""

    card: Card
    signing_keys: list[tuple[Ed25519PublicKey, float | None]] = field(
        default_factory=list
    )  # (key, valid_until)
    agreement_key: X25519PublicKey | None = None

    @property
    def name(self) -> str:
        return self.card.name

    @property
    def address(self) -> str | None:
        return self.card.address

    def verify(self, signature: bytes, data: bytes, now: float | None = None) -> bool:
        now = time.time() if now is None else now
        for key, valid_until in self.signing_keys:
            if valid_until is not None and now > valid_until:
                continue
            try:
                key.verify(signature, data)
                return True
            except InvalidSignature:
                continue
        return False


_P = 2**255 - 19
# The y coordinates of the Ed25519 points of order 1, 2, 4 and 8 (libsodium's
# list): Ed25519 verification (OpenSSL's too) accepts, for such a key, a
# signature anyone can make (R the base point, S = 1, for 1 message in 8 at
# worst), so a card naming one lets every stranger sign as that site.
_Y8 = 0x7A03AC9277FDC74EC6CC392CFA53202A0F67100D760B3CBA4FD84D3D706A17C7
_SMALL_ORDER_Y = frozenset({0, 1, _P - 1, _Y8, _P - _Y8})


def _verify_key(text: str, what: str, name: str, path: Path | None) -> Ed25519PublicKey:
    raw = _unb64(text, what, name)
    if (int.from_bytes(raw, "little") & ((1 << 255) - 1)) % _P in _SMALL_ORDER_Y:
        raise IdentityError(
            f"{path or 'roster'}: site {name!r} has a {what} anyone can forge signatures for "
            "(a small-order point) — ask the site for its real card"
        )
    return Ed25519PublicKey.from_public_bytes(raw)


class Roster:
    """The federation's sites by name."""

    def __init__(
        self, cards: list[Card], path: Path | None = None, relays: dict[str, str] | None = None
    ) -> None:
        self.path = path
        # relay name -> HOST:PORT (issue 31): where outbound-only sites are reached
        self.relays: dict[str, str] = dict(relays or {})
        self.sites: dict[str, RosterSite] = {}
        for card in cards:
            if card.name in self.sites:
                raise IdentityError(
                    f"{path or 'roster'}: site {card.name!r} listed twice — keep one entry"
                )
            keys: list[tuple[Ed25519PublicKey, float | None]] = [
                (_verify_key(card.signing_key, "signing_key", card.name, path), None)
            ]
            if card.previous_signing_key:
                key = _verify_key(
                    card.previous_signing_key, "previous_signing_key", card.name, path
                )
                keys.append((key, card.previous_valid_until or 0.0))
            agreement = X25519PublicKey.from_public_bytes(
                _unb64(card.agreement_key, "agreement_key", card.name)
            )
            try:  # a low-order point (all zeros, ...) makes every exchange with it fail
                X25519PrivateKey.generate().exchange(agreement)
            except ValueError:
                raise IdentityError(
                    f"{path or 'roster'}: site {card.name!r} has an agreement_key no key "
                    "exchange works with (a low-order point) — ask the site for its real card"
                ) from None
            self.sites[card.name] = RosterSite(card, keys, agreement)
        where = path or "roster"
        clash = sorted(set(self.relays) & set(self.sites))
        if clash:
            raise IdentityError(f"{where}: {clash[0]!r} names both a site and a relay — rename one")
        for card in cards:
            unknown = [r for r in card.via if r not in self.relays]
            if unknown:
                raise IdentityError(
                    f"{where}: site {card.name!r} names relay {unknown[0]!r}, which the roster's "
                    "`relays:` does not list — add it with its HOST:PORT"
                )

    def __contains__(self, name: object) -> bool:
        return name in self.sites

    def __getitem__(self, name: str) -> RosterSite:
        return self.sites[name]

    def names(self) -> list[str]:
        return sorted(self.sites)

    def cards(self) -> list[Card]:
        return [self.sites[n].card for n in self.names()]

    @classmethod
    def load(cls, path: Path) -> Roster:
        path = Path(path)
        try:
            # O_NONBLOCK: a FIFO at the name is refused, not waited on (it hung
            # the start, and a SIGHUP froze the running node's loop: a key review)
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            with os.fdopen(fd, "rb") as fh:
                mode = os.fstat(fh.fileno()).st_mode
                if not stat.S_ISREG(mode):
                    raise IdentityError(
                        f"{path}: roster is not a plain file — give the roster.yaml"
                    )
                if stat.S_IMODE(mode) & 0o002:
                    # whoever may rewrite the roster may add a key or swap one
                    raise IdentityError(
                        f"{path}: roster has mode {stat.S_IMODE(mode):04o}: any account on "
                        "this host may rewrite it — `chmod o-w` it, and check what it lists"
                    )
                raw = yaml.safe_load(fh.read().decode("utf-8"))
        except UnicodeDecodeError:
            raise IdentityError(f"{path}: roster is not UTF-8 text — fix its encoding") from None
        except FileNotFoundError:
            raise IdentityError(
                f"{path}: roster not found — create it with `p2pfl-node provision` or `p2pfl-node roster add`"
            ) from None
        except yaml.YAMLError as exc:
            raise IdentityError(
                f"{path}: roster is not valid YAML ({str(exc).splitlines()[0]}) — fix its syntax"
            ) from None
        except RecursionError:  # nesting deeper than the parser's stack
            raise IdentityError(f"{path}: roster nests too deep to be a roster") from None
        except OSError as exc:
            raise IdentityError(f"{path}: cannot read roster ({exc.strerror})") from None
        if not isinstance(raw, dict) or not isinstance(raw.get("sites"), list):
            raise IdentityError(
                f"{path}: roster must be a mapping with a `sites:` list of public cards"
            )
        cards = [
            Card.from_dict(entry, f"{path}: sites[{i}]") for i, entry in enumerate(raw["sites"])
        ]
        return cls(cards, path, relays=_relays(raw.get("relays"), str(path)))

    def save(self, path: Path | None = None) -> Path:
        path = Path(path or self.path or "roster.yaml")
        doc: dict[str, Any] = {"sites": [c.to_dict() for c in self.cards()]}
        if self.relays:
            doc["relays"] = [{"name": n, "address": a} for n, a in sorted(self.relays.items())]
        text = yaml.safe_dump(doc, sort_keys=False)
        return atomic_write_text(path, text, mode=PUBLIC_FILE)  # public keys and addresses


def load_card(path: Path) -> Card:
    try:
        raw = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise IdentityError(
            f"{path}: card not found — ask the site for the output of `p2pfl-node keygen`"
        ) from None
    except (yaml.YAMLError, RecursionError):  # RecursionError: nested too deep
        raise IdentityError(f"{path}: card is not valid YAML") from None
    except UnicodeDecodeError:  # a traceback out of `roster add` (a key review)
        raise IdentityError(f"{path}: card is not UTF-8 text — copy it again") from None
    except OSError as exc:  # a folder, no read permission: also a traceback
        raise IdentityError(f"{path}: cannot read the card ({exc.strerror})") from None
    return Card.from_dict(raw, str(path))
