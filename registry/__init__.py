"""Where checkpoints come from and where runs are recorded: MLflow tracking and its model registry.

One home for both the pipelines (which log runs and register checkpoints) and the server (which
resolves `models:/name@alias` to a directory), so neither reaches into the other. Sits above
`sala` (which never imports MLflow) and below `serve` and `pipelines`.
"""
