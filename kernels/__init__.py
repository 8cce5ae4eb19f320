"""CUDA C sources of gds_persist's device kernels, shipped as package data.

In a source checkout they live in the top-level ``kernels/`` directory; an installed wheel has
them as ``gds_persist/kernels/*.cu``. :func:`gds_persist.transfer.device_crc.kernel_source`
finds either.
"""
