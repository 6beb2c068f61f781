"""The coordinator's room: the catalog's owner (state), its control loops (controller), the
live moves it carries out (migrator) and what it shows (views). Nothing here knows Ray."""
