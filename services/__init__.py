"""Pagoda services."""
