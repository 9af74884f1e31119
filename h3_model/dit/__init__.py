"""The H3 diffusion transformer: config, packed layout, the model, LoRA merging, sequence parallelism."""
