"""Files and folders this process may not read or write, for the tests of what a command says
then (``deny``): the permission bits for a user; for root, who reads and writes every file
whatever its bits, the opens and folder creations there are refused in this process instead,
with the ``PermissionError`` the system would raise."""

from __future__ import annotations

import builtins
import errno
import io
import os
from pathlib import Path

import pytest

_WRITES = os.O_WRONLY | os.O_RDWR | os.O_CREAT


def _under(path, denied: list[str]) -> bool:
    try:
        full = os.path.abspath(os.fsdecode(path))
    except TypeError:  # a file descriptor
        return False
    return any(full == d or full.startswith(d + os.sep) for d in denied)


def _refuse(path) -> PermissionError:
    return PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fspath(path))


@pytest.fixture(name="deny")
def deny_access(monkeypatch):
    """``deny(path)``: a file becomes unreadable, a folder read-only (nothing can be made in
    it); undone after the test."""
    modes: dict[Path, int] = {}
    files: list[str] = []
    folders: list[str] = []

    def open_(real):
        def guarded(file, mode="r", *args, **kwargs):
            writes = any(c in mode for c in "wax+")
            if _under(file, files) or (writes and _under(file, folders)):
                raise _refuse(file)
            return real(file, mode, *args, **kwargs)
        return guarded

    def os_open(real):
        def guarded(file, flags, *args, **kwargs):
            if _under(file, files) or (flags & _WRITES and _under(file, folders)):
                raise _refuse(file)
            return real(file, flags, *args, **kwargs)
        return guarded

    def mkdir(real):
        def guarded(path, *args, **kwargs):
            if _under(path, folders):
                raise _refuse(path)
            return real(path, *args, **kwargs)
        return guarded

    if os.geteuid() == 0:
        for module, name, guard in ((builtins, "open", open_), (io, "open", open_),
                                    (os, "open", os_open), (os, "mkdir", mkdir)):
            monkeypatch.setattr(module, name, guard(getattr(module, name)))

    def make(path: Path) -> Path:
        path = Path(path)
        (folders if path.is_dir() else files).append(os.path.abspath(path))
        if os.geteuid() != 0:
            modes[path] = path.stat().st_mode
            path.chmod(0o555 if path.is_dir() else 0)
        return path

    yield make
    for path, mode in modes.items():
        path.chmod(mode)
