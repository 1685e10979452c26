"""Build hook: compiles the C core and the benchmark's physical limits through cffi (two modules),
plus the argument packer (metadata lives in pyproject.toml)."""
from setuptools import Extension, setup

setup(
    cffi_modules=["_cffi_build/build_core.py:ffibuilder", "_cffi_build/build_limits.py:ffibuilder"],
    ext_modules=[Extension("flagcx_mc._argpack", ["_cffi_build/argpack.c"], extra_compile_args=["-O2", "-Wall"])],
)
