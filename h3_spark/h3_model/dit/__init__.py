"""The H3 diffusion transformer: its config, the packed sequence layout, the model, sequence parallelism."""
