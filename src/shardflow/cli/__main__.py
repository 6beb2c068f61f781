"""``python -m shardflow.cli``: the ``shardflow`` command."""

from shardflow.cli import main

main()
