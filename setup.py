"""Build hook for the native library.

The C sources in native/ compile into one shared library, ``offload/_offload_native*.so``,
which ``offload/_native.py`` loads with ctypes. It is plain C with no Python or torch
headers; ISA-specific kernels use per-function ``target`` attributes and are picked at run
time, so one build runs on any x86-64 (no -march=native) and builds on aarch64.

Each update rule's file instantiates every kernel variant (gradient and state dtypes,
ISAs), so the rule files take most of a fresh set-up's time. Two settings keep it short:
``-fno-unswitch-loops`` (GCC otherwise copied each element loop once per combination of
the rule's hyper-parameter branches, such as SGD's weight decay, momentum and Nesterov
flags: sgd.c took 79 s to compile instead of 30 s and the library was 17.3 MB instead of
12.8 MB, with no measurable gain, since those branches are taken the same way for a whole
call and the kernels are memory-bound: bench_optim's rules against the probe and
bench_adam's rates were the same either way), and compiling the sources in parallel, one
compiler process per core (``ParallelBuildExt``). On a 2-core machine the build went from
203 s to 108 s.
"""
import glob
import os
from concurrent.futures import ThreadPoolExecutor

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class ParallelBuildExt(build_ext):
    """build_ext that compiles one extension's sources in parallel, a compiler process per core."""

    def build_extension(self, ext):
        compile_serial = self.compiler.compile

        def compile_parallel(sources, *args, **kwargs):
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
            with ThreadPoolExecutor(max_workers=cores or 1) as pool:
                jobs = [pool.submit(compile_serial, [src], *args, **kwargs) for src in sources]
                return [obj for job in jobs for obj in job.result()]

        self.compiler.compile = compile_parallel
        try:
            super().build_extension(ext)
        finally:
            self.compiler.compile = compile_serial


sources = sorted(glob.glob(os.path.join("native", "*.c")))
setup(
    cmdclass={"build_ext": ParallelBuildExt},
    ext_modules=[
        Extension(
            "offload._offload_native",
            sources=sources,
            include_dirs=["native"],
            extra_compile_args=["-O3", "-std=gnu11", "-fvisibility=hidden", "-fno-strict-aliasing",
                                "-Wall", "-Wno-unused-function", "-fno-math-errno", "-fno-unswitch-loops"],
            extra_link_args=["-pthread"],
            libraries=["pthread", "m", "dl"],
        )
    ]
)
