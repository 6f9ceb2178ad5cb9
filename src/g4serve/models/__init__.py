"""Model definitions (plain PyTorch)."""
