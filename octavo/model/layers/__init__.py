"""Shared building blocks of the model files."""
