"""The two optional C helpers; everything else about the package is in pyproject.toml.

Declared here rather than in `[tool.setuptools.ext-modules]`, which setuptools still
marks experimental (a warning on every install). Both are optional: without a C compiler
the package installs without them and the Python paths give the same answers, slower.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        # filter: node names compared as bytes (gpuplace/placement/names.py)
        Extension(
            "gpuplace.placement._names",
            ["gpuplace/placement/_names.c"],
            optional=True,
            extra_compile_args=["-O2"],
        ),
        # prioritize: the answer ranked and encoded in one pass (gpuplace/extender/wire.py)
        Extension(
            "gpuplace.extender._priorities",
            ["gpuplace/extender/_priorities.c"],
            optional=True,
            extra_compile_args=["-O2"],
        ),
    ]
)
