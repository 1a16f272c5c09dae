"""Build configuration beyond pyproject.toml: the optional C recording core.

``batchcraft.autobatching._core`` is an optional extension: where no C compiler works
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
        )
    ]
)
