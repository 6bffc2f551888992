"""The two optional C helpers of the extender's wire; everything else about the package
is in pyproject.toml.

Declared here rather than in `[tool.setuptools.ext-modules]`, which setuptools still
marks experimental (a warning on every install). Both are optional: without a C compiler
the package installs without them and the Python paths give the same answers, slower
(`GPUPLACE_NO_EXTENSIONS=1` takes those paths where they are built:
gpuplace/extender/c_helpers.py).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        # filter: node names compared as bytes (gpuplace/extender/node_names.py)
        Extension(
            "gpuplace.extender._node_names",
            ["gpuplace/extender/_node_names.c"],
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
