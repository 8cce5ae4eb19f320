"""Trainer integrations (docs/INTEGRATIONS.md): ``gds_persist.integrations.lightning`` (a
PyTorch Lightning ``CheckpointIO`` plugin) and ``gds_persist.integrations.accelerate``
(``save_state`` / ``load_state`` for Hugging Face Accelerate).

Importing this package imports nothing heavy; each submodule imports its framework when imported.
They use only gds_persist's public API.
"""
