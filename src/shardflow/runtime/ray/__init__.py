"""The only room that knows Ray: names, node environment, slots, the actor classes (pass-
throughs to the roles' own modules), the handles that call them, membership and bootstrap.

Every worker process loads ``actors``: this package imports nothing by itself."""
