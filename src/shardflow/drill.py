"""``python -m shardflow.drill``: the drill and its nemesis against a local multi-node
cluster (the same as ``python -m shardflow.tools.drill``; see that module)."""

from __future__ import annotations

from shardflow.tools.drill import main

if __name__ == "__main__":
    main()
