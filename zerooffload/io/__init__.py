"""The async-I/O layer (DESIGN §3): files, an AsyncIO facade over four backends, aligned host buffers.

``AsyncIO`` moves host buffers to and from files opened with ``open_file``, on the backend the config
names (``auto``: io_uring, else a native thread pool, else Python threads); ``aligned_empty`` and
``HostBufferPool`` give the page-aligned (pinned with CUDA) memory that O_DIRECT transfers need.
"""
from .aio import AsyncIO, Handle
from .buffers import HostBufferPool, aligned_empty
from .errors import AioError
from .files import AioFile, OffsetReader, open_file

__all__ = ["AioError", "AioFile", "AsyncIO", "Handle", "HostBufferPool", "OffsetReader", "aligned_empty", "open_file"]
