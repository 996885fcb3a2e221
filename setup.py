"""Build hook for the native library.

The C sources in native/ compile into one shared library, ``offload/_offload_native*.so``,
which ``offload/_native.py`` loads with ctypes. It is plain C with no Python or torch
headers; ISA-specific kernels use per-function ``target`` attributes and are picked at run
time, so one build runs on any x86-64 (no -march=native) and builds on aarch64.
"""
import glob
import os

from setuptools import Extension, setup

sources = sorted(glob.glob(os.path.join("native", "*.c")))
setup(
    ext_modules=[
        Extension(
            "offload._offload_native",
            sources=sources,
            include_dirs=["native"],
            extra_compile_args=["-O3", "-std=gnu11", "-fvisibility=hidden", "-fno-strict-aliasing",
                                "-Wall", "-Wno-unused-function", "-fno-math-errno"],
            extra_link_args=["-pthread"],
            libraries=["pthread", "m"],
        )
    ]
)
