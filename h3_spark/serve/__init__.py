"""The hot runtime service: models loaded once and kept resident, one GPU job at a time, an HTTP API.

Modules: validation (request fields and limits), outputs (confined input/output folders, atomic writes),
models (loading, kernel set-up, readiness and capability reports), jobs (queue and worker), execute (one
job on the resident models), service (the pieces together, no HTTP), app (Starlette routes), lockstep
(one job over several GPUs: rank 0 serves, the other ranks follow).
Start it with `h3-spark serve` (cli/serve.py).
"""
