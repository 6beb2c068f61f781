"""A second program on a data directory, for the ownership tests: it connects (starting an
embedded cluster of its own), reports on stdout as JSON lines, and obeys commands on stdin:

    create START COUNT   create table ``events`` with ids START..START+COUNT-1
    insert START COUNT   insert those ids into ``events``
    close                close the database and exit

Run as ``python -m tests.support.owner_process DATA_DIR [LEASE_TTL_S]``.
"""

from __future__ import annotations

import json
import os
import sys

import pyarrow as pa

import shardflow


def say(**event: object) -> None:
    print(json.dumps(event), flush=True)


def rows(start: int, count: int) -> pa.Table:
    return pa.table({"id": pa.array(range(start, start + count), pa.int64())})


def main() -> None:
    data_dir = sys.argv[1]
    ttl = float(sys.argv[2]) if len(sys.argv) > 2 else 10.0
    try:
        db = shardflow.connect(workers=2, data_dir=data_dir, lease_ttl_s=ttl, auto_balance=False)
    except shardflow.Error as error:
        say(event="refused", error=type(error).__name__, message=str(error))
        return
    coordinator = db._backend.handle.coordinator.pid().get()
    say(event="ready", pid=os.getpid(), coordinator_pid=coordinator)
    for line in sys.stdin:
        command, *args = line.split()
        if command == "close":
            break
        start, count = (int(a) for a in args)
        try:
            if command == "create":
                db.create_table("events", rows(start, count), distributed_by="id")
            else:
                db.insert("events", rows(start, count))
            say(event="acked", start=start, count=count)
        except shardflow.Error as error:
            say(event="failed", error=type(error).__name__, message=str(error))
    db.close()
    say(event="closed")


if __name__ == "__main__":
    main()
