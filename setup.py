"""The one compiled part of rlcomm: ``rlcomm.comm.transports._stream_copy``, copies that
write around the caches, a small message's frame joined in one call, and such a frame
put into (and taken from) a shared-memory ring in one call. It is optional: where it
cannot be built (no C compiler), the build goes on without it, rlcomm copies with the C
library's ``memmove`` (:mod:`rlcomm.comm.transports.bulk_copy`), joins frames with
``ctypes`` (:mod:`rlcomm.comm.framing`) and puts them into rings in Python
(:mod:`rlcomm.comm.transports.shm`). Everything else is in ``pyproject.toml``."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "rlcomm.comm.transports._stream_copy",
            sources=["rlcomm/comm/transports/_stream_copy.c"],
            extra_compile_args=["-O2"],
            optional=True,
        )
    ]
)
