"""The version of what the roles say to each other (the calls and answers of
``runtime/protocol/``, the fast lane's requests), and which versions serve together.

The rule, for rolling upgrades: a release speaks :data:`PROTOCOL` and serves beside a
release that speaks one less or one more (N and N-1 together: workers replaced one by
one under load, then the coordinator). A change an older release could not read takes the
next number; a release may use it only towards peers that speak it. A peer further apart
is refused when it meets the coordinator, with an error that names both versions: a
worker when it is admitted (it never serves: its info answers the version), a session
when it attaches (the coordinator's ``ping`` answers it). The data
directory's format has a rule of its own (``catalog/version.py``)."""

from __future__ import annotations

from shardflow.errors import ConfigError

PROTOCOL = 1
"""What this release speaks. Releases before the number was sent spoke 1."""


def check_peer(theirs: int, who: str, here: str = "coordinator", ours: int = PROTOCOL) -> None:
    """Refuse a peer (``who``) that speaks ``theirs``, more than one from ``ours``.

    >>> check_peer(2, "node-3", ours=1)
    >>> check_peer(3, "node-3", ours=1)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    shardflow.errors.ConfigError: node-3 speaks protocol 3 and this coordinator 1: ...
    """
    if abs(theirs - ours) > 1:
        raise ConfigError(
            f"{who} speaks protocol {theirs} and this {here} {ours}: releases one apart "
            "serve together, not more (upgrade one of them: CHANGELOG)"
        )
