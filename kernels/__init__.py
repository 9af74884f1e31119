"""GPU kernels, each next to its plain-PyTorch reference, and capability dispatch.

Entry points (import the modules directly; this package imports nothing so that `h3_model.dit` can
import `kernels.attention` without cycles):
- `kernels.settings.KernelSettings.from_env()`: the H3_* kernel flags, parsed once at a front door;
- `kernels.dispatch.apply_kernels(model, settings)`: configure a loaded H3DiT, returns the report;
- `kernels.attention.resolve_attention(name, device, settings)`: one attention backend.
See kernels/README.md for what each backend and fusion does, its error budget and where it runs.
"""
