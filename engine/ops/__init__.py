"""Ops interface: each backend implements the same functions; see reference.py."""
