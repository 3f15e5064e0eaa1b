"""The isolated sandbox's seccomp filter: no kernel keyrings. Stateless.

Keyrings are the one kernel store that namespaces do not separate here: bwrap runs as root, so a run's uid
keeps its user keyrings in the host's user namespace, where they outlive the run (the next run with that
uid would read them), and setpriv keeps the kernel's session keyring, which every run could write. Rather
than empty them run by run (a cleared key lingers until the kernel collects it), the filter refuses the
three keyring system calls (add_key, request_key, keyctl) with ENOSYS, as a kernel without keyrings would,
and refuses every call of a second ABI (x32, 32-bit int 0x80) whose numbers it does not check.

Written by hand as classic BPF (the form `bwrap --seccomp FD` reads): ten instructions, no libseccomp.
"""

from __future__ import annotations

import errno
import os
import struct

# linux/filter.h, linux/seccomp.h, linux/audit.h
_LD_W_ABS, _JEQ_K, _JGE_K, _RET_K = 0x20, 0x15, 0x35, 0x06
_ALLOW, _ERRNO = 0x7FFF0000, 0x00050000
_ARCHES = {  # machine → (AUDIT_ARCH, add_key, request_key, keyctl)
    "x86_64": (0xC000003E, 248, 249, 250),
    "aarch64": (0xC00000B7, 217, 218, 219),
}
_X32 = 0x40000000  # x86_64's x32 ABI: the same calls under other numbers


def _op(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("HBBI", code, jt, jf, k)


def keyring_filter(machine: str | None = None) -> bytes | None:
    """The filter for this machine (`os.uname().machine`), or None where its numbers are not known.

    >>> len(keyring_filter("x86_64")) // 8, keyring_filter("sparc")
    (10, None)
    """
    arch = _ARCHES.get(machine or os.uname().machine)
    if arch is None:
        return None
    audit, add_key, request_key, keyctl = arch
    refuse = _ERRNO | errno.ENOSYS
    return b"".join([
        _op(_LD_W_ABS, 4),  # 0: seccomp_data.arch
        _op(_JEQ_K, audit, jt=1),  # 1: our ABI → 3
        _op(_RET_K, refuse),  # 2: another ABI: refused
        _op(_LD_W_ABS, 0),  # 3: seccomp_data.nr
        _op(_JGE_K, _X32, jt=3),  # 4: x32 → 8
        _op(_JEQ_K, add_key, jt=2),  # 5 → 8
        _op(_JEQ_K, request_key, jt=1),  # 6 → 8
        _op(_JEQ_K, keyctl, jf=1),  # 7: keyctl → 8, anything else → 9
        _op(_RET_K, refuse),  # 8: refused
        _op(_RET_K, _ALLOW),  # 9: everything else
    ])


def filter_fd() -> int | None:
    """A readable descriptor holding the filter (a memfd, at offset 0), for `bwrap --seccomp`; the caller
    passes it to the child and closes it. None where the machine has no filter."""
    program = keyring_filter()
    if program is None:
        return None
    fd = os.memfd_create("polar-lab-seccomp", os.MFD_CLOEXEC)
    os.write(fd, program)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd
