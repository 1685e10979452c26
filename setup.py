"""Build hook: compiles the C core and the benchmark's physical limits through cffi (two modules),
plus the argument packer (metadata lives in pyproject.toml).

Every compiled module uses CPython's limited API of 3.10 (cffi's modules by default, the argument
packer through Py_LIMITED_API), so the wheel is tagged cp310-abi3: one wheel for every CPython
from 3.10 on."""
from setuptools import Extension, setup

LIMITED_API = "cp310"

setup(
    cffi_modules=["_cffi_build/build_core.py:ffibuilder", "_cffi_build/build_limits.py:ffibuilder"],
    ext_modules=[
        Extension(
            "flagcx_mc._argpack",
            ["_cffi_build/argpack.c"],
            define_macros=[("Py_LIMITED_API", "0x030A0000")],
            py_limited_api=True,
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter"],
        )
    ],
    options={"bdist_wheel": {"py_limited_api": LIMITED_API}},
)
