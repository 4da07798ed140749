"""Attention backends and fused ops, each paired with a torch reference it is tested against."""
