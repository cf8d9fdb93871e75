"""Pagoda gateway."""
