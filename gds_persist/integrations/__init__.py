"""Trainer integrations (docs/INTEGRATIONS.md): ``gds_persist.integrations.lightning`` (a
PyTorch Lightning ``CheckpointIO`` plugin), ``gds_persist.integrations.accelerate``
(``save_state`` / ``load_state`` for Hugging Face Accelerate) and
``gds_persist.integrations.deepspeed`` (``attach(engine)``: a DeepSpeed checkpoint engine).

Importing this package imports nothing heavy; each submodule imports its framework when imported
(also as an attribute: ``gds_persist.integrations.lightning`` after ``import gds_persist``).
They are the integrations layer (CONTRIBUTING.md): ``save``, ``load``, ``flatten`` and the
Checkpointer's snapshot machinery, never the package root.
"""

from __future__ import annotations

from .._lazy import lazy_submodules

__getattr__, __dir__ = lazy_submodules(__name__, globals(),
                                       ("accelerate", "deepspeed", "lightning"))
