"""Speculative decoding on the worker side: verification of the core's draft tokens."""
