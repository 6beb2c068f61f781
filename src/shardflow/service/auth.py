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
* **The audit log** (:class:`AuditLog`) gets one JSON line per refused login, denied call,
  control action and change of data: when, who, what, with which arguments, the outcome and
  how long it took.

Users and service tokens are plain JSON files under ``<data_dir>/auth/`` (directory 0700,
files 0600). Writers replace a file atomically while holding ``<data_dir>/auth/.lock``, so the
CLI may change them under a running server; readers re-read a file only when it changed on
disk, so a server sees ``shardflow user add`` at its next handshake, without a restart.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import hashlib
import hmac
import json
import os
import re
import secrets
import stat
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


def _aware(moment: datetime) -> datetime:
    """``moment`` with a time zone; a naive one is taken as local time."""
    return moment if moment.tzinfo is not None else moment.astimezone()


def _stamp(epoch_s: float, timespec: str = "seconds") -> str:
    return datetime.fromtimestamp(epoch_s, UTC).isoformat(timespec=timespec)


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """This process alone among all others in ``folder`` (made private if missing):
    ``flock`` on its ``.lock`` file."""
    _make_private_dir(folder)
    fd = os.open(folder / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _make_private_dir(path: Path) -> None:
    if not path.is_dir():
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(path, 0o700)  # mkdir's mode is masked by the umask


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
        _fsync_folder(self.path.parent)  # makes the rename itself durable
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
        with self._lock, _locked(self.dir):
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
    none of them keeps any. Signed tokens expire by the wall clock.

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
        """Whom ``token`` was issued to; None when it is unknown or expired."""
        if self._key is not None:
            return self._verified(token)
        with self._lock:
            entry = self._live.get(token)
            if entry is None:
                return None
            principal, expires = entry
            if expires <= self._clock():
                del self._live[token]
                return None
            return principal

    def _signed(self, principal: Principal) -> str:
        expires = round(self._clock() + self.ttl_s, 3)
        claims = {"n": principal.name, "r": principal.role, "k": principal.kind, "e": expires}
        body = _b64(json.dumps(claims, separators=(",", ":")).encode())
        return f"{SIGNED_PREFIX}{body}.{self._mac(body)}"

    def _mac(self, body: str) -> str:
        assert self._key is not None
        return _b64(hmac.new(self._key, body.encode(), hashlib.sha256).digest())

    def _verified(self, token: str) -> Principal | None:
        if not isinstance(token, str) or not token.startswith(SIGNED_PREFIX):
            return None
        body, _, mac = token[len(SIGNED_PREFIX) :].partition(".")
        if not hmac.compare_digest(mac.encode(), self._mac(body).encode()):
            return None
        try:
            claims = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
            principal = Principal(str(claims["n"]), str(claims["r"]), str(claims["k"]))
            expires = float(claims["e"])
        except (ValueError, KeyError, TypeError):
            return None
        return principal if expires > self._clock() else None

    def __len__(self) -> int:
        """Tokens held, expired ones not yet dropped included."""
        with self._lock:
            return len(self._live)


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _jsonable(value: Any) -> Any:
    """``value`` as JSON can hold it: containers walked, anything else unknown as text."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_jsonable(v) for v in value]
    return str(value)


AUDIT_FILE = "audit.jsonl"
GENESIS = "0" * 64
"""The ``prev`` of the first entry of an audit log."""
CHAIN_FIELDS = ("prev", "hash")
TAIL_BYTES = 1 << 20
"""How far back from a file's end its last entry is looked for (an entry is far shorter)."""


class AuditLog:
    """Append-only JSON lines in ``<data_dir>/audit/audit.jsonl``, one per request.

    **Chained.** Each entry carries the hash of the entry before it (``prev``) and its own
    (``hash``: SHA-256 of its other fields, ``prev`` included), so that a line removed,
    edited or moved breaks the chain where it was (:meth:`verify`).

    **Rotated.** Once the file reaches ``max_bytes``, or its first entry is ``max_age_s``
    old, it is renamed ``audit-<UTC time>.jsonl`` and a new one begins; the chain runs on
    from one file to the next. Rotated files are kept (archive or delete the oldest: the
    chain is checked from the oldest file there is).

    Writers (threads, and processes: several service replicas) append under an exclusive
    lock (``flock`` on ``audit/.lock``): read the last entry's hash, write the line in one
    ``write`` to a file opened with ``O_APPEND``, fsync. A line torn by a crash is skipped
    when read and by the chain. Every file is the owner's only (0600, the folder 0700):
    :meth:`check_private` refuses a log others can read.
    """

    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        max_bytes: int = 64 << 20,
        max_age_s: float = 30 * 86400.0,
    ) -> None:
        self.folder = Path(os.fspath(data_dir)) / "audit"
        self.path = self.folder / AUDIT_FILE
        self.max_bytes = max_bytes
        self.max_age_s = max_age_s
        self._lock = threading.Lock()
        self._last: tuple[tuple[int, int], str] | None = None
        """(inode, size) of the current file after our last look, and its last hash."""
        self._first: tuple[int, datetime | None] | None = None
        """The current file's inode and the time of its first entry."""

    def record(
        self,
        who: str,
        action: str,
        arguments: Mapping[str, Any],
        outcome: str,
        duration_s: float,
        when: datetime | None = None,
    ) -> None:
        """Append one entry; ``outcome`` is "ok", "denied: needs operator", "error: ..."."""
        moment = _aware(when) if when is not None else datetime.now(UTC)
        entry: dict[str, Any] = {
            "time": moment.astimezone(UTC).isoformat(timespec="milliseconds"),
            "who": who,
            "action": action,
            "arguments": _jsonable(arguments),
            "outcome": outcome,
            "duration_s": round(float(duration_s), 6),
        }
        with self._lock, self._exclusive():
            self._rotate_if_due()
            fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                entry["prev"] = self._last_hash(fd)
                entry["hash"] = _entry_hash(entry)
                line = (json.dumps(entry, ensure_ascii=False) + "\n").encode()
                written = os.write(fd, line)
                while written < len(line):  # only on a full disk or an interrupted write
                    written += os.write(fd, line[written:])
                os.fsync(fd)
                found = os.fstat(fd)
                self._last = ((found.st_ino, found.st_size), entry["hash"])
            finally:
                os.close(fd)

    def files(self) -> list[Path]:
        """The log's files, oldest first (rotated ones, then the current one)."""
        try:
            rotated = sorted(p for p in self.folder.glob("audit-*.jsonl"))
        except OSError:
            rotated = []
        return [*rotated, *([self.path] if self.path.exists() else [])]

    def entries(self, since: datetime | None = None) -> list[dict[str, Any]]:
        """The entries in the order written (every file), those at or after ``since`` only
        if given; without their chain fields."""
        start = _aware(since) if since is not None else None
        found: list[dict[str, Any]] = []
        for entry, _, _ in self._read():
            if start is not None:
                try:
                    moment = _aware(datetime.fromisoformat(str(entry.get("time"))))
                except ValueError:
                    continue
                if moment < start:
                    continue
            found.append({k: v for k, v in entry.items() if k not in CHAIN_FIELDS})
        return found

    def verify(self) -> AuditCheck:
        """Walk the chain through every file: the entries, the torn lines skipped, and the
        first place it breaks (None: intact)."""
        running: str | None = None
        count = torn = 0
        for entry, where, _ in self._read(torn_too=True):
            if entry is None:
                torn += 1
                continue
            count += 1
            if "hash" not in entry:  # written before entries were chained
                if running is not None:
                    return AuditCheck(count, torn, f"{where}: an entry without its hash")
                continue
            if running is not None and entry.get("prev") != running:
                return AuditCheck(
                    count,
                    torn,
                    f"{where}: the chain breaks before it (a line removed, edited or moved)",
                )
            if _entry_hash(entry) != entry["hash"]:
                return AuditCheck(count, torn, f"{where}: this line was edited")
            running = str(entry["hash"])
        return AuditCheck(count, torn, None)

    def check_private(self) -> None:
        """Refuse (``ConfigError``) an audit folder or file that others than its owner may
        read or write."""
        for path in [self.folder, *self.files(), self.folder / ".lock"]:
            try:
                mode = stat.S_IMODE(os.stat(path).st_mode)
            except FileNotFoundError:
                continue
            if mode & 0o077:
                raise ConfigError(
                    f"{path} is open to others (mode {mode:o}); the audit log is its owner's "
                    f"only: chmod {'700' if path.is_dir() else '600'} {path}"
                )

    # -- inside -------------------------------------------------------------------------
    def _exclusive(self) -> contextlib.AbstractContextManager[None]:
        return _locked(self.folder)

    def _rotate_if_due(self) -> None:
        try:
            found = os.stat(self.path)
        except FileNotFoundError:
            return
        due = found.st_size >= self.max_bytes
        if not due and self.max_age_s > 0:
            if self._first is None or self._first[0] != found.st_ino:
                self._first = (found.st_ino, _first_time(self.path))
            first = self._first[1]
            due = first is not None and time.time() - first.timestamp() >= self.max_age_s
        if due:
            stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S.%fZ")
            os.replace(self.path, self.folder / f"audit-{stamp}.jsonl")
            _fsync_folder(self.folder)

    def _last_hash(self, fd: int) -> str:
        """The hash of the last entry before this one (under the lock): of the current
        file, else of the newest rotated file, else :data:`GENESIS`. A torn last line gets
        its newline first, so that this entry starts a line of its own."""
        found = os.fstat(fd)
        if self._last is not None and self._last[0] == (found.st_ino, found.st_size):
            return self._last[1]
        if found.st_size:
            tail = os.pread(fd, min(TAIL_BYTES, found.st_size), max(0, found.st_size - TAIL_BYTES))
            if not tail.endswith(b"\n"):
                os.write(fd, b"\n")
            last = _last_entry_hash(tail)
            if last is not None:
                return last
        for older in reversed(self.files()[:-1]):
            last = _last_entry_hash(_tail(older))
            if last is not None:
                return last
        return GENESIS

    def _read(self, torn_too: bool = False) -> Iterator[tuple[Any, str, Path]]:
        for path in self.files():
            try:
                lines = path.open("rb")
            except FileNotFoundError:  # rotated meanwhile: read where it went
                continue
            with lines:
                for number, raw in enumerate(lines, 1):
                    try:
                        entry = json.loads(raw)
                    except ValueError:  # torn by a crash mid-write (or blank)
                        entry = None
                    if not isinstance(entry, dict):
                        if torn_too and raw.strip():
                            yield None, f"{path.name}:{number}", path
                        continue
                    yield entry, f"{path.name}:{number}", path


@dataclass(frozen=True)
class AuditCheck:
    """What :meth:`AuditLog.verify` found."""

    entries: int
    torn: int
    """Lines torn by a crash mid-write (skipped; the chain runs past them)."""
    broken: str | None
    """Where the chain first breaks (file:line and why), or None."""


def _entry_hash(entry: Mapping[str, Any]) -> str:
    body = {k: v for k, v in entry.items() if k != "hash"}
    canonical = json.dumps(body, ensure_ascii=False, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def _last_entry_hash(tail: bytes) -> str | None:
    for raw in reversed(tail.split(b"\n")):
        try:
            entry = json.loads(raw)
        except ValueError:
            continue
        if isinstance(entry, dict) and isinstance(entry.get("hash"), str):
            return str(entry["hash"])
    return None


def _tail(path: Path) -> bytes:
    with path.open("rb") as handle:
        size = handle.seek(0, os.SEEK_END)
        handle.seek(max(0, size - TAIL_BYTES))
        return handle.read()


def _first_time(path: Path) -> datetime | None:
    try:
        with path.open("rb") as handle:
            first = json.loads(handle.readline())
        return _aware(datetime.fromisoformat(str(first["time"])))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _fsync_folder(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
        return _aware(datetime.fromisoformat(stripped))
    except ValueError:
        raise ConfigError(
            f"since takes an age such as 30s, 10m, 2h or 1d, or an ISO-8601 time, not {text!r}"
        ) from None


def _account_id(record: Mapping[str, Any]) -> str:
    """An account's id: its own, or for one made before ids, when it was made."""
    return str(record.get("id") or record.get("created", ""))
