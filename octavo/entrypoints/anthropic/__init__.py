"""Anthropic Messages API endpoints."""
