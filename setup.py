"""The one compiled part of kvcached; everything else is declared in pyproject.toml.

`kvcached.backends.cuda._vmm_calls` makes the CUDA backend's per-page driver calls from
C (see the top of its source for why). It needs no CUDA headers or libraries, only a C
compiler and Python's headers, and it is optional: where it does not build, the
backend makes the same calls through cuda.bindings, and `kvcached info` says which.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvcached.backends.cuda._vmm_calls",
            sources=["backends/cuda/_vmm_calls.c"],
            optional=True,
        )
    ]
)
