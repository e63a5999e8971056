"""Which filesystem a path is on, and whether it is a network or FUSE one.

SQLite's write-ahead log, which dpprof records runs in, keeps its index in a memory-mapped ``-shm``
file that every connection shares through one host's memory: on a network filesystem (NFS, SMB,
Lustre, GPFS, Ceph, 9p, ...) or a FUSE mount it is not safe (https://sqlite.org/wal.html). On Linux
the type comes from statfs(2)'s ``f_type`` and from the mount table (``/proc/self/mountinfo``, the
mount with the longest mount point holding the path), which also names FUSE mounts (``fuse.sshfs``).
Elsewhere nothing is known and a path counts as local.
"""
from __future__ import annotations

import ctypes
import functools
import os
import platform
import re
import sys
from dataclasses import dataclass

__all__ = ["Filesystem", "filesystem_of", "classify", "mount_type", "nothing_made_in", "NETWORK_MAGIC", "NETWORK_TYPES",
           "KERNEL_FILESYSTEMS"]

# Filesystems whose directories take no new files whoever asks (root too): the kernel's views of itself.
KERNEL_FILESYSTEMS = frozenset({"proc", "sysfs", "cgroup", "cgroup2", "debugfs", "securityfs", "tracefs",
                                "configfs", "efivarfs", "bpf", "pstore"})

# statfs f_type of the network, cluster and FUSE filesystems (linux/magic.h, coreutils' stat.c)
NETWORK_MAGIC: dict[int, str] = {
    0x6969: "nfs",
    0x517B: "smb",
    0xFF534D42: "cifs",
    0xFE534D42: "smb2",
    0x65735546: "fuse",  # every FUSE mount (sshfs, gcsfuse, s3fs, ...), fuseblk and virtiofs too
    0x0BD00BD0: "lustre",
    0x47504653: "gpfs",
    0x00C36400: "ceph",
    0x01021997: "9p",
    0x5346414F: "afs",
    0x6B414653: "afs",  # the kernel's kAFS
    0x73757245: "coda",
    0x564C: "ncp",
    0x19830326: "beegfs",
    0x01161970: "gfs2",
    0x7461636F: "ocfs2",
    0xAAD7AAEA: "panfs",
    0xBEEFDEAD: "stornext",
    0x013111A8: "ibrix",
    0x61636673: "acfs",
    0xBACBACBC: "vmhgfs",  # VMware shared folders
    0x7C7C6673: "prl_fs",  # Parallels shared folders
}
# the same, by the type names the mount table gives (a FUSE mount's is fuse.<program>)
NETWORK_TYPES = frozenset({
    "nfs", "nfs4", "smb", "smbfs", "smb2", "smb3", "cifs", "fuse", "fuseblk", "lustre", "gpfs", "ceph", "9p",
    "afs", "coda", "ncp", "ncpfs", "beegfs", "fhgfs", "gfs2", "ocfs2", "panfs", "glusterfs", "orangefs", "pvfs2",
    "wekafs", "virtiofs", "vboxsf", "vmhgfs", "prl_fs", "acfs",
})
MOUNTINFO = "/proc/self/mountinfo"
_STATFS_BYTES = 512  # more than struct statfs on any Linux ABI (120 bytes on 64-bit)
_ESCAPED = re.compile(r"\\([0-7]{3})")  # mountinfo writes a space in a mount point as \040


@dataclass(frozen=True)
class Filesystem:
    """A path's filesystem: its type ("ext4", "nfs4", "fuse.sshfs", "0x1234abcd", "unknown") and whether
    it is a network or FUSE filesystem, where SQLite's write-ahead log is not safe."""

    type: str
    network: bool


def nothing_made_in(path: str | os.PathLike[str]) -> str | None:
    """"nothing can be made in /proc (a proc filesystem)" where the nearest existing directory at or above ``path`` is
    on one of the KERNEL_FILESYSTEMS (which answer a new file or directory with "no such file or directory"); None
    elsewhere."""
    found = os.path.abspath(path)
    while not os.path.lexists(found) and os.path.dirname(found) != found:
        found = os.path.dirname(found)
    if not os.path.isdir(found):
        return None
    kind = filesystem_of(found).type
    return f"nothing can be made in {found} (a {kind} filesystem)" if kind in KERNEL_FILESYSTEMS else None


def filesystem_of(path: str | os.PathLike[str]) -> Filesystem:
    """The filesystem ``path`` is on (the nearest existing directory above it, if it does not exist yet).

    Example:
        >>> filesystem_of("/mnt/shared/reports")
        Filesystem(type='nfs4', network=True)
    """
    where = os.path.realpath(path)
    while not os.path.exists(where) and os.path.dirname(where) != where:
        where = os.path.dirname(where)
    return classify(_statfs_magic(where), _mounted_type(where))


def classify(magic: int | None, mounted: str | None) -> Filesystem:
    """A Filesystem from statfs's f_type and the mount table's type name (either may be None)."""
    by_magic = NETWORK_MAGIC.get(magic) if magic is not None else None
    name = mounted or by_magic or (f"0x{magic:08x}" if magic is not None else "unknown")
    network = by_magic is not None or (mounted is not None and mounted.split(".")[0] in NETWORK_TYPES)
    return Filesystem(name, network)


def mount_type(path: str, mountinfo: str) -> str | None:
    """The type of the mount holding the absolute, resolved ``path`` in a mountinfo text: the one with the
    longest mount point above it, the last one listed where several are mounted on the same point."""
    best, best_len = None, -1
    for line in mountinfo.splitlines():
        left, dash, right = line.partition(" - ")
        fields, after = left.split(), right.split()
        if not dash or len(fields) < 5 or not after:
            continue
        point = _ESCAPED.sub(lambda m: chr(int(m.group(1), 8)), fields[4])
        inside = point == "/" or path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= best_len:
            best, best_len = after[0], len(point)
    return best


def _mounted_type(path: str) -> str | None:
    try:
        with open(MOUNTINFO, encoding="utf-8", errors="replace") as f:
            return mount_type(path, f.read())
    except OSError:  # not Linux, or no /proc
        return None


@functools.lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def _statfs_magic(path: str) -> int | None:
    """statfs(2)'s f_type for ``path`` on Linux; None elsewhere, or when the call fails."""
    libc = _libc() if sys.platform.startswith("linux") else None
    if libc is None or not hasattr(libc, "statfs"):
        return None
    buf = ctypes.create_string_buffer(_STATFS_BYTES)
    if libc.statfs(os.fsencode(path), buf) != 0:
        return None
    # f_type is the struct's first field: a word (__fsword_t) on every Linux ABI but s390x's 32 bits
    word = ctypes.c_uint32 if platform.machine() == "s390x" else ctypes.c_long
    return word.from_buffer(buf).value & 0xFFFFFFFF
