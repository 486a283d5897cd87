"""Pallas kernels, by target."""
