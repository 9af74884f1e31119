"""GPU kernels, each next to its plain-PyTorch reference, and capability dispatch.

kernels/ imports nothing of the engine (h3_model/): the modules the model runs by default and the fused
kernels subclass (`RowModulation`, `SwiGLU`) live in `kernels.references`, the NVFP4 format's codec in
`kernels.nvfp4_codec`, and `plan_kernels` reaches a model's stored format through the `checkpoint_origin` the
loader leaves on it. The kernels decide and build; the engine installs them on the model
(`h3_model.engine.kernel_plan.apply_kernels`). Entry points (import the modules directly; this package's own import loads nothing):
- `kernels.settings.KernelSettings.from_env()` / `kernel_settings(attention, linear)`: the H3_* kernel flags,
  parsed once at a front door;
- `kernels.dispatch.plan_kernels(model, settings)`: every kernel choice for a loaded H3DiT, checked;
- `kernels.attention.resolve_attention(name, device, settings)`: one attention backend.
See kernels/README.md for what each backend and fusion does, its error budget and where it runs.
"""
