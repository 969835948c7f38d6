"""Typed messages: what crosses the bus, and the bodies of the HTTP APIs."""
