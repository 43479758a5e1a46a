"""The session inspector: its routes on the server and the proxy (`routes`) and its page (`static/`)."""
