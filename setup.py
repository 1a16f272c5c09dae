"""Build configuration beyond pyproject.toml: the optional C recording core.

``batchcraft.autobatching._core`` (and ``_fused``, the fused elementwise kernels) are optional extensions: where no C compiler works
(``CC=/bin/false pip install .``) the install still succeeds and batchcraft uses its
pure-Python core (``batchcraft.autobatching._native`` says which one loaded).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "batchcraft.autobatching._core",
            ["src/batchcraft/autobatching/_core.c"],
            optional=True,
            extra_compile_args=["-O2", "-fno-strict-aliasing"],
        ),
        # fused elementwise tails (fuse.py): -O3 vectorizes the per-row loops; no contraction of
        # a multiply and an add into one rounding, so add/mul round as torch's do
        Extension(
            "batchcraft.autobatching._fused",
            ["src/batchcraft/autobatching/_fused.c"],
            optional=True,
            extra_compile_args=["-O3", "-ffp-contract=off", "-fno-strict-aliasing"],
        ),
    ]
)
