"""Where LocalAI's ``TTS`` writes its WAV: ``dst``, checked once and written relative to the folder it named.

``dst`` is a request's path, taken literally (``~`` is not expanded, as in a request's ``voice``): a new file
in an existing, writable folder, inside ``output_dir`` when that is set, never inside a protected folder
(model, bundle, voices, references). The folder is opened once (``O_DIRECTORY | O_NOFOLLOW``) when it is
checked; the file is created in that open folder (``dir_fd``, ``O_CREAT | O_EXCL | O_NOFOLLOW``), so a folder
swapped for a symbolic link while the audio is generated changes nothing: the WAV goes where the check
looked, or nowhere. Every refusal — a NUL byte, a name longer than the file system takes, a missing folder,
an existing file or link, a protected folder — is one :class:`DstRefused` with one message.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

MAX_SHOWN = 200         # characters of a refused dst the message repeats


class DstRefused(Exception):
    """``dst`` is not a new file in a writable output folder (the one message for every reason)."""

    def __init__(self, dst: str):
        shown = dst if len(dst) <= MAX_SHOWN else dst[:MAX_SHOWN] + "…"
        super().__init__(f"dst {shown!r}: not a new file in a writable output folder (see the output_dir option)")


class DstWriteFailed(Exception):
    """The checked file could not be written (a full disk, an I/O error); it was removed."""


class OutputFile:
    """A checked ``dst``: its folder held open, the file not yet created. Close it (a context manager)."""

    def __init__(self, dst: str, protected: list[str | Path | None], output_dir: str | Path | None):
        if "\0" in dst:
            raise DstRefused(dst)
        path = Path(dst)
        self.dst, self.name = dst, path.name
        if not self.name or self.name in (".", "..") or dst.endswith(("/", os.sep)):
            raise DstRefused(dst)
        try:
            folder = path.parent.resolve(strict=True)
            if len(os.fsencode(self.name)) > os.pathconf(folder, "PC_NAME_MAX"):
                raise DstRefused(dst)
            if any(f and folder.is_relative_to(Path(f).resolve()) for f in protected):
                raise DstRefused(dst)
            if output_dir and not folder.is_relative_to(Path(output_dir).resolve()):
                raise DstRefused(dst)
            self.fd: int | None = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except (OSError, RuntimeError, ValueError):
            raise DstRefused(dst) from None
        # the folder opened is the folder checked (no component swapped between the two), writable, and the
        # name is free (not even a dangling link)
        try:
            opened = os.readlink(f"/proc/self/fd/{self.fd}") if os.path.isdir("/proc/self/fd") else str(folder)
            usable = opened == str(folder) and os.access(".", os.W_OK, dir_fd=self.fd) and not self._exists()
        except (OSError, ValueError):
            usable = False
        if not usable:
            self.close()
            raise DstRefused(dst)
        self.folder = folder

    def _exists(self) -> bool:
        try:
            os.stat(self.name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        return True

    @property
    def path(self) -> Path:
        return self.folder / self.name

    def write_wav(self, samples: np.ndarray, sample_rate: int) -> None:
        """A 16-bit mono PCM WAV with real sizes, created in the checked folder (never over a file or a link)."""
        import soundfile as sf

        if self.fd is None:              # closed: never a name resolved from the working directory instead
            raise DstRefused(self.dst)
        try:
            fd = os.open(self.name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644,
                         dir_fd=self.fd)
        except OSError:                  # it appeared meanwhile (a file, a link), or the folder went read-only
            raise DstRefused(self.dst) from None
        try:
            with os.fdopen(fd, "wb") as f:
                sf.write(f, samples, sample_rate, subtype="PCM_16", format="WAV")
        except Exception as e:  # noqa: BLE001 - a full disk, an I/O error: the partial file goes
            try:
                os.unlink(self.name, dir_fd=self.fd)
            except OSError:
                pass
            raise DstWriteFailed(f"dst {str(self.path)!r}: writing the WAV failed: {e}") from None

    def close(self) -> None:
        fd, self.fd = getattr(self, "fd", None), None
        if fd is not None:
            os.close(fd)

    def __enter__(self) -> "OutputFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

