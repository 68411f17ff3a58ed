"""Named POSIX shared memory owned by a worker, mapped as numpy arrays.

Interoperates with the daemon's base/shm_segment.h: names are "/wb-<prefix>-<pid>-<n>-<rand>"
(a leading '/', no other '/', <= 255 chars), created new (O_EXCL) with mode 0600 so the daemon's
CheckOwner (same uid, no group/other bits) accepts them, sized with ftruncate (zero-filled). On
Linux shm_open(name) is the file /dev/shm/<name without '/'>, which is what we open.
The creator unlinks the name on close(); mapped memory stays valid until the mapping is released.
"""

import itertools
import mmap
import operator
import os
import secrets

import numpy as np

_SHM_DIR = "/dev/shm"
_counter = itertools.count()


def unique_name(prefix):
    return "/wb-%s-%d-%d-%d" % (prefix, os.getpid(), next(_counter), secrets.randbelow(1 << 31))


def validate_name(name):
    if not name.startswith("/") or "/" in name[1:] or len(name) < 2 or len(name) > 255:
        raise ValueError("invalid POSIX shm name %r: need a leading '/', no other '/', 2..255 chars" % name)


def byte_count(what, value):
    """`value` as a number of bytes: an integer (numpy integers too), never a float (int(1.5) would
    quietly make a 1-byte buffer) nor a bool."""
    if isinstance(value, bool):
        raise TypeError("%s must be an integer number of bytes, got %r" % (what, value))
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError("%s must be an integer number of bytes, got %r" % (what, value)) from None


class SharedBuffer:
    """One shm segment. `id` is its buffer_id in layouts (creation order within a client)."""

    def __init__(self, name, size_bytes, buffer_id=0, populate=False):
        validate_name(name)
        size_bytes = byte_count("shm %s: size" % name, size_bytes)
        if size_bytes <= 0:
            raise ValueError("shm %s: size must be > 0, got %d" % (name, size_bytes))
        self.name = name
        self.id = buffer_id
        self.size_bytes = size_bytes
        path = os.path.join(_SHM_DIR, name[1:])
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.fchmod(fd, 0o600)  # umask can only remove bits, but be explicit
            os.ftruncate(fd, self.size_bytes)
            flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
            self._mmap = mmap.mmap(fd, self.size_bytes, flags=flags)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        os.close(fd)  # the mapping keeps the segment alive
        self._path = path
        self._unlinked = False
        self.bytes = np.frombuffer(self._mmap, dtype=np.uint8)

    def array(self, dtype, shape, offset_bytes=0):
        """A numpy view of `shape` elements of `dtype` starting at `offset_bytes` (no copy)."""
        dtype = np.dtype(dtype)
        count = int(np.prod(shape)) if len(shape) else 1
        end = offset_bytes + count * dtype.itemsize
        if offset_bytes < 0 or end > self.size_bytes:
            raise ValueError("shm %s: view [%d, %d) outside the %d-byte buffer" % (self.name, offset_bytes, end, self.size_bytes))
        return np.frombuffer(self._mmap, dtype=dtype, count=count, offset=offset_bytes).reshape(shape)

    def unlink(self):
        if not self._unlinked:
            self._unlinked = True
            try:
                os.unlink(self._path)
            except FileNotFoundError:
                pass

    def close(self):
        """Unlinks the name. The mapping is released when no numpy view references it any more."""
        self.unlink()
        self.bytes = None

    def __repr__(self):
        return "SharedBuffer(id=%d, name=%r, size_bytes=%d)" % (self.id, self.name, self.size_bytes)
