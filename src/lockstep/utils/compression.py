"""Checkpoints compressed by a command-line tool (``ep1.pt.gz``, ``ep1.pt.zst``), as Composer's
``composer.utils.compression``: the data is piped through ``gzip``, ``zstd``, ... found on ``PATH``."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
from collections.abc import Iterator
from typing import IO

__all__ = ["KNOWN_COMPRESSORS", "CliCompressor", "CompressorNotFound", "get_compressor", "is_compressed_pt"]


class CompressorNotFound(FileNotFoundError):
    """No compressor for a file's extension, or its command is not on ``PATH``."""


def is_compressed_pt(filename: str) -> bool:
    """Whether ``filename`` names one ``.pt`` file compressed as a whole (``x.pt.gz``; not ``x.pt.symlink``)."""
    parts = filename.split(".")
    return len(parts) >= 2 and parts[-2] == "pt" and parts[-1] != "symlink"


class CliCompressor:
    """A compressor run as a command: ``extension`` without its dot, ``cmd`` the program (the
    extension when not given). ``compress(path)`` and ``decompress(path)`` give a byte stream to
    write to or read from."""

    def __init__(self, extension: str, cmd: str | None = None) -> None:
        self.extension = extension
        self.cmd = cmd if cmd is not None else extension

    def __repr__(self) -> str:
        return f"CliCompressor({self.extension!r}, {self.cmd!r})"

    @property
    def exists(self) -> bool:
        """Whether the command is on ``PATH``."""
        return shutil.which(self.cmd) is not None

    def check_exists(self) -> None:
        if not self.exists:
            raise CompressorNotFound(f"{self.cmd!r} is not on PATH: install it to read or write .{self.extension} "
                                     f"checkpoints")

    @contextlib.contextmanager
    def compress(self, out_filename: str) -> Iterator[IO[bytes]]:
        """A stream whose bytes end up compressed in ``out_filename``."""
        self.check_exists()
        with open(out_filename, "wb") as out:
            proc = subprocess.Popen([self.cmd], stdin=subprocess.PIPE, stdout=out)
            assert proc.stdin is not None
            try:
                yield proc.stdin
            finally:
                proc.stdin.close()
                code = proc.wait()
        if code != 0:
            raise OSError(f"{self.cmd} failed with exit code {code} writing {out_filename}")

    @contextlib.contextmanager
    def decompress(self, in_filename: str) -> Iterator[IO[bytes]]:
        """A stream of the bytes ``in_filename`` holds, decompressed."""
        self.check_exists()
        proc = subprocess.Popen([self.cmd, "-dc", in_filename], stdout=subprocess.PIPE)
        assert proc.stdout is not None
        try:
            yield proc.stdout
        finally:
            proc.stdout.close()
            code = proc.wait()
        if code != 0:
            raise OSError(f"{self.cmd} failed with exit code {code} reading {in_filename}")


KNOWN_COMPRESSORS = [CliCompressor("bz2", "bzip2"), CliCompressor("gz", "gzip"), CliCompressor("lz4"),
                     CliCompressor("lzma"), CliCompressor("lzo", "lzop"), CliCompressor("xz"),
                     CliCompressor("zst", "zstd")]


def get_compressor(filename: str) -> CliCompressor:
    """The compressor of a compressed ``.pt`` file, by its extension."""
    if not is_compressed_pt(filename):
        raise ValueError(f"{filename!r} is not a compressed .pt file (such as ep1.pt.gz)")
    extension = filename.rsplit(".", 1)[-1]
    for compressor in KNOWN_COMPRESSORS:
        if compressor.extension == extension:
            return compressor
    raise CompressorNotFound(f"no compressor for {filename!r}: lockstep knows "
                             f"{', '.join('.' + c.extension for c in KNOWN_COMPRESSORS)}")
