"""Imported by Python at start when this folder is on PYTHONPATH: the process may open no TCP
or UDP socket, as on the lent TPU v5e, whose sandbox refuses them all, loopback too (errno 97,
as it answers: shared/docs/V5E.md). Unix sockets work, as there. tests/test_execute_host.py
runs the CLI under it."""

import errno
import socket

_Socket = socket.socket
_REFUSED = (socket.AF_INET, socket.AF_INET6)


class _NoInternetSocket(_Socket):
    def __init__(self, family=-1, type=-1, proto=-1, fileno=None):
        if fileno is None and (family == -1 or family in _REFUSED):
            raise OSError(errno.EAFNOSUPPORT, "Address family not supported by protocol")
        super().__init__(family, type, proto, fileno)


socket.socket = _NoInternetSocket  # type: ignore[misc]
