"""Quantized weight formats and the kernels that run them."""
