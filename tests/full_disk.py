"""A file whose disk fills up, for tests of failed checkpoint writes (also in spawned ranks)."""

from __future__ import annotations

import errno


class FillingFile:
    """A file object whose disk is full once ``room`` bytes are written: every later ``write``
    raises ``OSError(ENOSPC)``, as ``write(2)`` does on a full disk."""

    def __init__(self, file, room: int) -> None:
        self.file, self.room = file, room

    def write(self, data) -> int:
        data = bytes(data)
        if len(data) > self.room:
            self.file.write(data[: self.room])
            self.room = 0
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room -= len(data)
        return self.file.write(data)

    def __getattr__(self, name):
        return getattr(self.file, name)
