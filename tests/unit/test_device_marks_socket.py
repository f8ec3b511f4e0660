"""The device marks' socket calls that keep the GIL: a send the kernel cannot take whole at once
still sends everything, in order; a connection is seen closed, or holding something to read."""

from __future__ import annotations

import socket
import threading

from asyncinfer.broker.device_marks import _closed, _send_all


def test_a_send_larger_than_the_socket_buffer_arrives_whole_and_in_order() -> None:
    ours, theirs = socket.socketpair()
    ours.settimeout(10)
    data = bytes(range(256)) * 8192  # 2 MiB: more than a socket buffer takes at once
    got = bytearray()

    def read() -> None:
        while len(got) < len(data):
            chunk = theirs.recv(65536)
            if not chunk:
                return
            got.extend(chunk)

    reader = threading.Thread(target=read)
    reader.start()
    _send_all(ours, data)
    reader.join(timeout=30)
    assert bytes(got) == data
    ours.close()
    theirs.close()


def test_a_connection_is_seen_closed_or_holding_a_reply_and_open_otherwise() -> None:
    ours, theirs = socket.socketpair()
    assert _closed(ours) is False
    theirs.sendall(b"+OK\r\n")  # a reply where none should come
    assert _closed(ours) is True
    assert ours.recv(5) == b"+OK\r\n" and _closed(ours) is False
    theirs.close()  # the peer went away
    assert _closed(ours) is True
    ours.close()
