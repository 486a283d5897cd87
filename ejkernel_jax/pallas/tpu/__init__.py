"""Pallas TPU kernels. Off TPU they run in Pallas interpret mode."""
