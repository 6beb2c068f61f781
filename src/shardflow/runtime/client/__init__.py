"""The client's room: the session (plans, routes and runs queries, inserts, loads) and the
Ray runner that carries its fragments."""
