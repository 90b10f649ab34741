"""Embedded tasks (the defaults of the demo and the tests)."""
