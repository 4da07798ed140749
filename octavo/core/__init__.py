"""Engine core: scheduling and KV-cache bookkeeping in pure Python and numpy (no torch)."""
