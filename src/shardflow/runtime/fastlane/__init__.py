"""A worker's fast lane: a fragment whose result goes to the client and whose inputs, if
any, the client holds (a query routed to one shard, above all; a later stage reading what
the client merged) is asked and answered over a TCP connection the client keeps open to
that worker, its inputs sent along, not through a Ray actor call, whose submission,
scheduling and object-store round trip cost more than a point lookup itself (measured:
~1 ms of the client's CPU and ~0.6 ms of the worker's per call, against ~0.1 ms for a
framed request on a socket).

The worker listens on its node's address (the address Ray gives it) on a port of the
system's choosing, and learns nothing from a peer before it sent the worker's token: 16
random bytes the client obtained through Ray, which authenticates that call. Requests are
JSON (the worker unpickles nothing a peer sends); answers are the fragment's measurements
(pickled, as Ray would send them) and its result as one Arrow IPC stream, or the worker's
error. A lane that fails (its worker died, a connection broke) raises :class:`LaneBroken`;
the session then uses Ray for that worker, whose answer says what happened.

A load sends its rows the same way (:meth:`Lanes.stage`): Arrow IPC straight into the
worker, not through Ray's object store, whose shared memory keeps every page a load passed
through resident in the worker's process and the store (~0.15 GiB a worker after loading
TPC-H SF 1 lineitem and orders on four; ``bench/memory.py``). The target of a move pulls
its source's snapshot the same way, chunk by chunk (:meth:`Lanes.chunk`).
"""

from shardflow.runtime.fastlane.client import (
    LANE_THREADS,
    STEP_TIMEOUT_S,
    LaneBook,
    LaneBroken,
    Lanes,
)
from shardflow.runtime.fastlane.frames import (
    ARROW_FRAME_BYTES,
    MOVE_STEPS,
    STREAM_FRAME_BYTES,
    TOKEN_BYTES,
    from_wire,
    slices,
    to_wire,
)
from shardflow.runtime.fastlane.server import LaneServer, MoveSource, ReaderGone, Run

__all__ = [
    "ARROW_FRAME_BYTES",
    "LANE_THREADS",
    "MOVE_STEPS",
    "STEP_TIMEOUT_S",
    "STREAM_FRAME_BYTES",
    "TOKEN_BYTES",
    "LaneBook",
    "LaneBroken",
    "LaneServer",
    "Lanes",
    "MoveSource",
    "ReaderGone",
    "Run",
    "from_wire",
    "slices",
    "to_wire",
]
