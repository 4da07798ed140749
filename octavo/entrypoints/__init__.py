"""Entry points: the command line (and, later, the HTTP servers)."""
