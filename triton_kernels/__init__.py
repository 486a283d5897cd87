"""Triton kernels and their launch plans. Imports triton only: no torch, no jax."""
from .plan import HOPPER, HOPPER_GLUON, DeviceFacts, LaunchPlan, Output

__all__ = ["DeviceFacts", "HOPPER", "HOPPER_GLUON", "LaunchPlan", "Output"]
