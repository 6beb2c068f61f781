"""The worker's room: one node's shards and fragments, and its two halves of a live move.
Nothing here knows Ray."""
