"""Executors run a SchedulerOutput on the workers and return one ModelOutput."""
