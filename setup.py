"""Build hook: compiles the C core through cffi (metadata lives in pyproject.toml)."""
from setuptools import setup

setup(cffi_modules=["_cffi_build/build_core.py:ffibuilder"])
