"""Workspace tooling (not a published package): package discovery, the dependency graph,
change-based selection, and the shared environments the nox sessions run in."""
