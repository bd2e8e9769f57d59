"""Hand-written compute kernels."""

from quickdraft.kernels.cpu_linear import kernel_available, skinny_linear

__all__ = ["kernel_available", "skinny_linear"]
