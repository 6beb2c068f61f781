"""Tools built on the public API: the demo and its scaling story, the node-loss drill, and
the local multi-node Ray cluster (with its node processes' entry point)."""
