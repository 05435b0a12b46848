"""Checkpointless fault tolerance for FSDP2 training with PyTorch Lightning.

Importing the package is cheap: torch and Lightning load only when a submodule
that needs them is imported, so ``launch.py --help`` stays fast.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
