"""Implementation of :mod:`ejkernel_torch.interop` (see that module for the public API)."""
