"""sglang-hisparse: an out-of-tree HiSparse implementation for SGLang decode workers.

Importing this package never imports SGLang: the kernel, memory and coordinator layers
run without it (see docs/architecture.md). Only ``plugin``, ``arg_hook`` and
``sglang_adapter`` touch ``sglang``.
"""

__version__ = "0.1.0"

SUPPORTED_SGLANG = "0.5.23"
