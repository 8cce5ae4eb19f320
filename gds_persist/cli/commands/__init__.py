"""Subcommands of ``gds-persist``, one module each (see ``gds_persist.cli``)."""
