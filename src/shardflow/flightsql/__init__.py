"""Flight SQL, both ends' shared part and the client: ``wire`` builds and reads the protocol's
messages and metadata schemas; ``client`` is ``connect("grpc://...")``'s RemoteDatabase.
The server is ``shardflow.service``."""
