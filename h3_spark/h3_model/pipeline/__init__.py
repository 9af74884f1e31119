"""The generation pipeline: flow-matching schedule, sampler, step caches and the staged generation."""
