"""Protocol-neutral serving pieces: chat templates, tool-call parsers, reasoning parsers."""
