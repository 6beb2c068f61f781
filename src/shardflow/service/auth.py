"""Who may use the network service, what each may do, and the record of what they did.

The model:

* **Users** log in with a name and a password. ``users.json`` keeps an argon2id hash of each
  password (argon2-cffi, its RFC 9106 defaults), never the password itself.
* **Handshake, then a bearer token.** A client proves its password once, in the Flight
  handshake, and gets a random bearer token (:class:`TokenIssuer`) that lasts
  ``Settings.token_ttl_s``. Bearer tokens live in the server's memory only: a restart logs
  every session out.
* **Service tokens** are for machines: ``sft_`` and 256 random bits, made with ``shardflow
  token create``, shown once, valid until revoked or until their own expiry. ``tokens.json``
  keeps only their SHA-256 — a fast hash is enough for a random token, unlike a password.
* **Three roles**, each allowed everything of the ones before it: ``reader`` (read),
  ``writer`` (also change data), ``operator`` (also run the cluster and its accounts).
* **The audit log** (:class:`shardflow.audit.AuditLog`) gets one JSON line per refused
  login, denied call, control action and change of data: when, who, what, with which
  arguments, the outcome and how long it took.

Users and service tokens are plain JSON files under ``<data_dir>/auth/`` (directory 0700,
files 0600). Writers replace a file atomically while holding ``<data_dir>/auth/.lock``, so the
CLI may change them under a running server; readers re-read a file only when it changed on
disk, so a server sees ``shardflow user add`` at its next handshake, without a restart.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import json
import os
import re
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from argon2 import PasswordHasher
from argon2.exceptions import InvalidHashError, VerificationError

from shardflow.audit import aware, fsync_folder, locked
from shardflow.errors import ConfigError

ROLES = ("reader", "writer", "operator")
TOKEN_PREFIX = "sft_"
# Bounds the issuer's memory (about 300 bytes a token, so some 30 MB) against a flood of
# handshakes; the oldest sessions are the ones that lose their token.
MAX_LIVE_TOKENS = 100_000
SIGNED_PREFIX = "sfb1."
"""Bearer tokens signed with the data directory's key (valid on every replica)."""
_NAME = re.compile(r"[A-Za-z0-9_.@-]{1,64}")
_AGE = re.compile(r"(\d+(?:\.\d+)?)\s*([smhd])")
_SECONDS_PER_UNIT = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def check_role(role: str) -> str:
    """``role`` itself if it is one of :data:`ROLES`; otherwise a ``ConfigError``."""
    if role not in ROLES:
        raise ConfigError(f"unknown role {role!r}; a role is one of: {', '.join(ROLES)}")
    return role


def role_allows(role: str, needed: str) -> bool:
    """Whether a principal with ``role`` may do what needs ``needed``.

    >>> role_allows("operator", "writer"), role_allows("reader", "writer")
    (True, False)

    An unknown ``role`` (a hand-edited file) allows nothing; an unknown ``needed`` is a bug
    in the caller and raises ``ConfigError``.
    """
    check_role(needed)
    return role in ROLES and ROLES.index(role) >= ROLES.index(needed)


@dataclass(frozen=True)
class Principal:
    """Whom a request runs as: a user who logged in, or the account of a service token."""

    name: str
    role: str
    kind: str  # "user" or "service"
    account_id: str = field(default="", compare=False)
    """The account's own id (new each time an account is made): a grant to it names this
    too, so an account removed and made again under the name inherits nothing."""


def _check_name(name: str, what: str) -> None:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ConfigError(
            f"invalid {what} name {name!r}: use 1 to 64 letters, digits and the characters _.@-"
        )


def _stamp(epoch_s: float, timespec: str = "seconds") -> str:
    return datetime.fromtimestamp(epoch_s, UTC).isoformat(timespec=timespec)


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class _JsonFile:
    """One JSON object of records in a file, cached until the file changes on disk.

    Not thread-safe by itself: :class:`AuthStore` holds its lock around every call.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._seen: tuple[int, int, int] | None = None  # inode, mtime, size of the cached read
        self._data: dict[str, dict[str, Any]] = {}

    def read(self) -> dict[str, dict[str, Any]]:
        """The file's records; do not change the dict returned (copy it, then :meth:`write`)."""
        try:
            stat = os.stat(self.path)
        except FileNotFoundError:
            self._seen, self._data = None, {}
            return self._data
        # os.replace gives the file a new inode, so a rewrite is seen even within the mtime's
        # resolution and at an equal size.
        seen = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
        if seen != self._seen:
            try:
                data = json.loads(self.path.read_bytes())
            except FileNotFoundError:
                data = {}
            except ValueError as error:
                raise ConfigError(
                    f"{self.path} is damaged ({error}); restore it from a backup"
                ) from None
            if not isinstance(data, dict) or not all(isinstance(r, dict) for r in data.values()):
                raise ConfigError(f"{self.path} is damaged (not an object of records)")
            self._seen, self._data = seen, data
        return self._data

    def write(self, data: dict[str, dict[str, Any]]) -> None:
        """Replace the file atomically: a reader sees the old or the new records, never part."""
        text = json.dumps(data, indent=2, sort_keys=True) + "\n"
        temporary = self.path.with_name(f".{self.path.name}.{secrets.token_hex(8)}.tmp")
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as out:
                out.write(text)
                out.flush()
                os.fsync(out.fileno())
            os.replace(temporary, self.path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temporary)
            raise
        fsync_folder(self.path.parent)  # makes the rename itself durable
        stat = os.stat(self.path)
        self._seen, self._data = (stat.st_ino, stat.st_mtime_ns, stat.st_size), data


class AuthStore:
    """Users and service tokens of one data directory, in ``<data_dir>/auth/``.

    ``hasher`` lets tests use cheap argon2 parameters; hashes made with other parameters
    are upgraded at the user's next login. ``clock`` (seconds since the epoch) dates records
    and decides service token expiry.
    """

    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        hasher: PasswordHasher | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        where = os.fspath(data_dir)
        if "://" in where:
            raise ConfigError(f"accounts are kept in a local data directory, not in {where!r}")
        self.dir = Path(where) / "auth"
        self._hasher = hasher or PasswordHasher()
        self._clock = clock
        self._users = _JsonFile(self.dir / "users.json")
        self._tokens = _JsonFile(self.dir / "tokens.json")
        self._lock = threading.RLock()  # the caches, within this process
        self._dummy_hash: str | None = None

    @contextlib.contextmanager
    def _writing(self) -> Iterator[None]:
        """Exclusive access: this thread within the process, this process among all others."""
        with self._lock, locked(self.dir):
            yield

    # -- users ------------------------------------------------------------------------------
    def add_user(self, name: str, role: str, password: str) -> None:
        """A new user; ``ConfigError`` for a taken or invalid name, a bad role or no password."""
        _check_name(name, "user")
        check_role(role)
        if not isinstance(password, str) or not password:
            raise ConfigError("a user needs a password; an empty one is refused")
        hashed = self._hasher.hash(password)  # slow by design: outside the lock
        with self._writing():
            users = dict(self._users.read())
            if name in users:
                raise ConfigError(f"user {name!r} exists; remove it first to replace it")
            users[name] = {
                "role": role,
                "hash": hashed,
                "created": _stamp(self._clock()),
                "id": secrets.token_hex(8),
            }
            self._users.write(users)

    def remove_user(self, name: str) -> None:
        with self._writing():
            users = dict(self._users.read())
            if users.pop(name, None) is None:
                raise ConfigError(f"no user {name!r}; `shardflow user list` shows them")
            self._users.write(users)

    def users(self) -> list[dict[str, str]]:
        """Every user by name: name, role and when it was created (ISO-8601); no hashes."""
        with self._lock:
            records = self._users.read()
        return [
            {"name": name, "role": str(r.get("role")), "created": str(r.get("created"))}
            for name, r in sorted(records.items())
        ]

    def verify_password(self, name: str, password: str) -> Principal | None:
        """The user ``name`` if ``password`` is theirs, else None.

        An unknown name costs one argon2 verification as well, against a hash of a random
        password, so that the time of a refusal does not tell which users exist.
        """
        with self._lock:
            record = self._users.read().get(name)
        stored = str(record["hash"]) if record is not None else self._dummy()
        try:
            self._hasher.verify(stored, password)
        except (VerificationError, InvalidHashError):
            return None
        if record is None:  # no password matches the random dummy's, but never rely on it
            return None
        if self._hasher.check_needs_rehash(stored):
            self._rehash(name, stored, password)
        return Principal(name, str(record["role"]), "user", _account_id(record))

    def _dummy(self) -> str:
        with self._lock:
            if self._dummy_hash is None:
                self._dummy_hash = self._hasher.hash(secrets.token_urlsafe(32))
            return self._dummy_hash

    def _rehash(self, name: str, old: str, password: str) -> None:
        """Store the password's hash with the current parameters (it was verified)."""
        new = self._hasher.hash(password)
        # The login succeeded whether or not the upgrade can be written (a read-only store).
        with contextlib.suppress(OSError), self._writing():
            users = dict(self._users.read())
            if name in users and users[name].get("hash") == old:  # not changed meanwhile
                users[name] = {**users[name], "hash": new}
                self._users.write(users)

    # -- service tokens ---------------------------------------------------------------------
    def create_service_token(
        self, role: str, name: str | None = None, ttl_s: float | None = None
    ) -> tuple[str, str]:
        """A new service token: ``(name, token)``. Only the token's SHA-256 is kept, so the
        token cannot be shown again. ``ttl_s`` None: valid until revoked."""
        check_role(role)
        name = f"svc-{secrets.token_hex(4)}" if name is None else name
        _check_name(name, "service token")
        if ttl_s is not None and not ttl_s > 0:
            raise ConfigError(f"a token's ttl must be a positive number of seconds, not {ttl_s}")
        token = TOKEN_PREFIX + secrets.token_urlsafe(32)
        now = self._clock()
        record = {
            "name": name,
            "role": role,
            "created": _stamp(now),
            "id": secrets.token_hex(8),
            "expires": None if ttl_s is None else _stamp(now + ttl_s, "microseconds"),
        }
        with self._writing():
            tokens = dict(self._tokens.read())
            if any(r.get("name") == name for r in tokens.values()):
                raise ConfigError(f"a service token named {name!r} exists; pick another name")
            tokens[_digest(token)] = record
            self._tokens.write(tokens)
        return name, token

    def put_service_token(self, name: str, role: str, token: str) -> None:
        """Keep ``token`` (made elsewhere, e.g. a Kubernetes Secret) as the service token
        ``name``, valid until revoked; an older token of that name stops being valid."""
        check_role(role)
        _check_name(name, "service token")
        if not token.startswith(TOKEN_PREFIX) or len(token) < len(TOKEN_PREFIX) + 32:
            raise ConfigError(
                f"a service token starts with {TOKEN_PREFIX!r} and has at least 32 more "
                'characters (make one with: python -c "import secrets; '
                f"print('{TOKEN_PREFIX}' + secrets.token_urlsafe(32))\")"
            )
        record = {
            "name": name,
            "role": role,
            "created": _stamp(self._clock()),
            "id": secrets.token_hex(8),
            "expires": None,
        }
        with self._writing():
            tokens = {h: r for h, r in self._tokens.read().items() if r.get("name") != name}
            tokens[_digest(token)] = record
            self._tokens.write(tokens)

    def service_tokens(self) -> list[dict[str, Any]]:
        """Every service token: name, role, created, expires (None: never), expired; no hashes."""
        with self._lock:
            records = list(self._tokens.read().values())
        now = self._clock()
        return [
            {
                "name": str(r.get("name")),
                "role": str(r.get("role")),
                "created": str(r.get("created")),
                "expires": r.get("expires"),
                "expired": _expired(r, now),
            }
            for r in sorted(records, key=lambda r: (str(r.get("created")), str(r.get("name"))))
        ]

    def revoke_token(self, name: str) -> None:
        with self._writing():
            tokens = self._tokens.read()
            kept = {h: r for h, r in tokens.items() if r.get("name") != name}
            if len(kept) == len(tokens):
                raise ConfigError(f"no service token {name!r}; `shardflow token list` shows them")
            self._tokens.write(kept)

    def signing_key(self) -> bytes:
        """The key that signs bearer tokens, made once per data directory (in
        ``auth/signing.key``, readable by this user only): every replica of the service
        serving the directory accepts the tokens any of them issued."""
        path = self.dir / "signing.key"
        with self._writing():
            try:
                return bytes.fromhex(path.read_text().strip())
            except FileNotFoundError:
                pass
            key = secrets.token_bytes(32)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w", encoding="utf-8") as out:
                out.write(key.hex() + "\n")
                out.flush()
                os.fsync(out.fileno())
            return key

    def current(self, principal: Principal) -> Principal | None:
        """``principal`` as the store has it now: a user removed since their token was
        issued has none (None), and their role is the one they have now. Read at every call
        (the file is read again only when it changed), so a removal ends every session on its
        next call. Service tokens are read from the store anyway."""
        if principal.kind != "user":
            return principal
        with self._lock:
            record = self._users.read().get(principal.name)
        if record is None:
            return None
        return Principal(principal.name, str(record["role"]), "user", _account_id(record))

    def principal_for_token(self, token: str) -> Principal | None:
        """The account of a service token; None if unknown, revoked or expired."""
        if not isinstance(token, str) or not token.startswith(TOKEN_PREFIX):
            return None
        with self._lock:
            record = self._tokens.read().get(_digest(token))
        if record is None or _expired(record, self._clock()):
            return None
        return Principal(str(record["name"]), str(record["role"]), "service", _account_id(record))

    def account(self, name: str) -> Principal | None:
        """The user or service account called ``name`` (what a grant to it names), or
        None."""
        with self._lock:
            user = self._users.read().get(name)
            if user is not None:
                return Principal(name, str(user["role"]), "user", _account_id(user))
            tokens = [r for r in self._tokens.read().values() if r.get("name") == name]
        if not tokens:
            return None
        record = tokens[0]
        return Principal(name, str(record["role"]), "service", _account_id(record))


def _expired(record: Mapping[str, Any], now: float) -> bool:
    expires = record.get("expires")
    return expires is not None and datetime.fromisoformat(str(expires)).timestamp() <= now


class TokenIssuer:
    """Bearer tokens handed out after a password handshake, each valid for ``ttl_s``.

    Without a ``key`` they are random and kept in this process's memory; with one they
    carry whom they were issued to and when they expire, signed (HMAC-SHA256) with the
    key, so that any process holding the key accepts them (the service's replicas) and
    none of them needs to keep any (each keeps those it verified, to check them again at
    a dictionary's cost). Signed tokens expire by the wall clock.

    >>> issuer = TokenIssuer(ttl_s=60.0)
    >>> token = issuer.issue(Principal("ada", "reader", "user"))
    >>> issuer.resolve(token)
    Principal(name='ada', role='reader', kind='user', account_id='')
    >>> issuer.resolve("a guess") is None
    True
    """

    def __init__(
        self,
        ttl_s: float,
        clock: Callable[[], float] | None = None,
        max_live: int = MAX_LIVE_TOKENS,
        key: bytes | None = None,
    ) -> None:
        if not ttl_s > 0:
            raise ConfigError(f"a bearer token's lifetime must be positive, not {ttl_s}")
        if max_live < 1:
            raise ConfigError(f"a token issuer must hold at least one token, not {max_live}")
        self.ttl_s = ttl_s
        self._key = key
        self._clock = clock or (time.time if key is not None else time.monotonic)
        self._max_live = max_live
        # In issue order, which with one ttl and a monotonic clock is also expiry order.
        self._live: OrderedDict[str, tuple[Principal, float]] = OrderedDict()
        self._lock = threading.Lock()

    def issue(self, principal: Principal) -> str:
        if self._key is not None:
            return self._signed(principal)
        token = secrets.token_urlsafe(32)
        with self._lock:
            now = self._clock()
            while self._live:
                oldest = next(iter(self._live))
                if self._live[oldest][1] > now:
                    break
                del self._live[oldest]
            while len(self._live) >= self._max_live:
                self._live.popitem(last=False)
            self._live[token] = (principal, now + self.ttl_s)
        return token

    def resolve(self, token: str) -> Principal | None:
        """Whom ``token`` was issued to; None when it is unknown or expired. A signed token
        verified once is kept (as an issued one is, at most ``max_live``): each call of a
        client checks it against that, not its signature again."""
        with self._lock:
            entry = self._live.get(token)
            if entry is not None:
                principal, expires = entry
                if expires > self._clock():
                    return principal
                del self._live[token]
                return None
        if self._key is None:
            return None
        verified, expires = self._verified(token)
        if verified is not None:
            with self._lock:
                while len(self._live) >= self._max_live:
                    self._live.popitem(last=False)
                self._live[token] = (verified, expires)
        return verified

    def _signed(self, principal: Principal) -> str:
        expires = round(self._clock() + self.ttl_s, 3)
        claims = {"n": principal.name, "r": principal.role, "k": principal.kind, "e": expires}
        body = _b64(json.dumps(claims, separators=(",", ":")).encode())
        return f"{SIGNED_PREFIX}{body}.{self._mac(body)}"

    def _mac(self, body: str) -> str:
        assert self._key is not None
        return _b64(hmac.new(self._key, body.encode(), hashlib.sha256).digest())

    def _verified(self, token: str) -> tuple[Principal | None, float]:
        """A signed token's holder and expiry (None: forged, damaged or expired)."""
        if not isinstance(token, str) or not token.startswith(SIGNED_PREFIX):
            return None, 0.0
        body, _, mac = token[len(SIGNED_PREFIX) :].partition(".")
        if not hmac.compare_digest(mac.encode(), self._mac(body).encode()):
            return None, 0.0
        try:
            claims = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
            principal = Principal(str(claims["n"]), str(claims["r"]), str(claims["k"]))
            expires = float(claims["e"])
        except (ValueError, KeyError, TypeError):
            return None, 0.0
        return (principal, expires) if expires > self._clock() else (None, 0.0)

    def __len__(self) -> int:
        """Tokens held, expired ones not yet dropped included."""
        with self._lock:
            return len(self._live)


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def parse_since(text: str, now: datetime | None = None) -> datetime:
    """The moment ``text`` names: an age ("30s", "10m", "2h", "1d") before ``now``, or an
    ISO-8601 time (local time when it has no zone).

    >>> parse_since("2h", now=datetime(2025, 1, 1, 12, tzinfo=UTC)).isoformat()
    '2025-01-01T10:00:00+00:00'
    """
    stripped = text.strip()
    age = _AGE.fullmatch(stripped)
    if age is not None:
        seconds = float(age[1]) * _SECONDS_PER_UNIT[age[2]]
        return (now if now is not None else datetime.now(UTC)) - timedelta(seconds=seconds)
    try:
        return aware(datetime.fromisoformat(stripped))
    except ValueError:
        raise ConfigError(
            f"since takes an age such as 30s, 10m, 2h or 1d, or an ISO-8601 time, not {text!r}"
        ) from None


def _account_id(record: Mapping[str, Any]) -> str:
    """An account's id: its own, or for one made before ids, when it was made."""
    return str(record.get("id") or record.get("created", ""))
