"""quantization."""
