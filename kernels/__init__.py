"""GPU kernels, each next to its plain-PyTorch reference. Capability dispatch lives here."""
