"""Parallel execution across ranks: process groups, collectives, rank placement."""
