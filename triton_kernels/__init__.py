"""Triton kernels and their launch plans. Imports triton only: no torch, no jax."""
from .plan import HOPPER, DeviceFacts, LaunchPlan, Output

__all__ = ["DeviceFacts", "HOPPER", "LaunchPlan", "Output"]
