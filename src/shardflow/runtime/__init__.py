"""Ray-facing effects: worker and coordinator actors, the client session, cluster bootstrap."""

import os

# Ray binds an embedded local cluster to 127.0.0.1 only when this is "0" in the process that
# starts it, and reads it when Ray is first imported: so it is set here, before any import of
# Ray by shardflow. Set it to "1" yourself to let this process join a multi-machine cluster.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
