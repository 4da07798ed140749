"""Protocol-neutral serving pieces: chat templates (later: tool-call and reasoning parsers)."""
