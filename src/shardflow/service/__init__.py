"""The network service: Flight SQL server, authentication, roles, audit."""
