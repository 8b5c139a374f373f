"""The package's one compiled part: sglang_cp/l3/_native (the L3 store's CRC32C, write staging copy, native read
engine and hit-query key hasher), built here by the package build and shipped in the wheel, never compiled on a
serving host at run time. Everything else is in pyproject.toml.

The build is optional: without a C compiler the package installs without it, says so, and a store
configured to use it (io.read_engine = "native" or "uring", index.digest_threads > 0) refuses to start with an
error naming the field and the fix; the default Python paths need nothing compiled."""

import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

NATIVE = "python/sglang_cp/l3/native/"


class OptionalBuildExt(build_ext):
    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as e:  # noqa: BLE001  (distutils raises several unrelated types for a failed compile)
            sys.stderr.write(
                f"WARNING: sglang-cp: building {ext.name} failed ({e}); installing without it. The L3 store's "
                "native and io_uring read engines and native key hasher are then unavailable "
                "(io.read_engine = \"python\" and "
                "index.digest_threads = 0 still work); install a C compiler and reinstall to get them.\n")


setup(
    ext_modules=[Extension(
        "sglang_cp.l3._native",
        sources=[NATIVE + f for f in ("module.c", "crc32c.c", "read_pages.c", "read_uring.c", "key_digests.c",
                                      "page_runs.c", "held_probe.c", "stage_pages.c", "write_runs.c")],
        depends=[NATIVE + "cpl3_native.h"],
        extra_compile_args=["-O3", "-std=gnu11", "-pthread", "-fvisibility=default"],
        extra_link_args=["-pthread"],
        define_macros=[("Py_LIMITED_API", "0x030A0000")],
        py_limited_api=True,
    )],
    cmdclass={"build_ext": OptionalBuildExt},
    options={"bdist_wheel": {"py_limited_api": "cp310"}},
)
