"""Build hook: compiles the C core through cffi, plus the argument packer (metadata lives in pyproject.toml)."""
from setuptools import Extension, setup

setup(
    cffi_modules=["_cffi_build/build_core.py:ffibuilder"],
    ext_modules=[Extension("flagcx_mc._argpack", ["_cffi_build/argpack.c"], extra_compile_args=["-O2", "-Wall"])],
)
