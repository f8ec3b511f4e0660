"""The gateway's system shared-memory regions (gateway/shared_memory.py) over real POSIX shared
memory: register, read, write, status, unregister, and each refusal in Triton's words."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from multiprocessing import shared_memory

import pytest

from asyncinfer.gateway.call_errors import GatewayError
from asyncinfer.gateway.shared_memory import DISABLED, SharedMemory, shm_reference


@pytest.fixture()
def block() -> Iterator[shared_memory.SharedMemory]:
    shm = shared_memory.SharedMemory(name=f"ai-test-{uuid.uuid4().hex[:12]}", create=True,
                                     size=3 * 4096)
    try:
        yield shm
    finally:
        shm.close()
        shm.unlink()


def test_a_region_is_read_and_written_where_the_caller_said(block) -> None:
    regions = SharedMemory(allowed=True)
    key = "/" + block.name
    block.buf[5000:5004] = b"abcd"
    regions.register("in", key, 4096, 8192)  # a region that starts at a page
    regions.register("odd", key, 4999, 100)  # and one that does not
    assert regions.read("x", "in", 904, 4) == b"abcd"
    assert regions.read("x", "odd", 1, 4) == b"abcd"
    regions.write("x", "odd", 10, 6, b"wxyz")
    assert bytes(block.buf[5009:5013]) == b"wxyz"
    assert regions.status("in") == [{"name": "in", "key": key, "offset": 4096, "byte_size": 8192}]
    assert [r["name"] for r in regions.status()] == ["in", "odd"]
    regions.unregister("in")
    assert [r["name"] for r in regions.status()] == ["odd"]
    regions.unregister()
    assert regions.status() == []
    regions.close()


def test_each_refusal_names_the_rule_in_tritons_words(block) -> None:
    key = "/" + block.name
    with pytest.raises(GatewayError, match="^Client shared memory is disabled") as off:
        SharedMemory(allowed=False).register("r", key, 0, 16)
    assert off.value.message == DISABLED and off.value.grpc_code == "UNIMPLEMENTED"
    with pytest.raises(GatewayError, match="served by a gateway of one process"):
        SharedMemory(allowed=True, processes=2).register("r", key, 0, 16)
    regions = SharedMemory(allowed=True)
    regions.register("r", key, 0, 16)
    cases = [
        (lambda: regions.register("r", key, 0, 16), "shared memory region 'r' already in manager"),
        (lambda: regions.register("s", "/no-such-" + uuid.uuid4().hex, 0, 16),
         "Unable to open shared memory region: '/no-such-"),
        (lambda: regions.register("s", "../etc/passwd", 0, 16),
         "Unable to open shared memory region: '../etc/passwd' (a key is a POSIX shared-memory "
         "name"),
        (lambda: regions.register("s", key, 0, 3 * 4096 + 1),
         "failed to register shared memory region 's': invalid args"),
        (lambda: regions.register("s", key, -1, 4), "'offset' must be a non-negative integer"),
        (lambda: regions.status("nope"), "Unable to find system shared memory region: 'nope'"),
        (lambda: regions.read("input 'x'", "nope", 0, 4),
         "input 'x': Unable to find system shared memory region: 'nope'"),
        (lambda: regions.read("input 'x'", "r", 16, 4),
         "Invalid offset for shared memory region: 'r'"),
        (lambda: regions.read("input 'x'", "r", 8, 9),
         "Invalid offset + byte size for shared memory region: 'r'"),
        (lambda: regions.write("output 'y'", "r", 0, 4, b"12345"),
         "output 'y': shared memory size specified with the request for output (4 bytes) should "
         "be at least 5 bytes to hold the results"),
    ]
    for call, message in cases:
        with pytest.raises(GatewayError) as caught:
            call()
        assert message in caught.value.message, caught.value.message
    assert [r["name"] for r in regions.status()] == ["r"]
    regions.close()


def test_a_tensors_reference_is_read_from_its_parameters() -> None:
    assert shm_reference("x", {}) is None
    assert shm_reference("x", {"shared_memory_region": "r", "shared_memory_byte_size": 8}) == (
        "r", 0, 8)
    assert shm_reference("x", {"shared_memory_region": "r", "shared_memory_offset": 4,
                               "shared_memory_byte_size": 8}) == ("r", 4, 8)
    for parameters, message in [
        ({"shared_memory_region": "r"}, "needs 'shared_memory_byte_size'"),
        ({"shared_memory_byte_size": 8}, "without 'shared_memory_region'"),
        ({"shared_memory_region": "r", "shared_memory_byte_size": -1}, "must be a non-negative"),
        ({"shared_memory_region": 5, "shared_memory_byte_size": 1}, "must be a region's name"),
    ]:
        with pytest.raises(GatewayError, match=message):
            shm_reference("x", parameters)


def test_an_object_shrunk_under_its_region_is_refused_not_a_crash(block) -> None:
    # Given a region registered over the object's last page
    regions = SharedMemory(allowed=True)
    regions.register("tail", "/" + block.name, 2 * 4096, 4096)
    assert regions.read("x", "tail", 0, 4) == b"\0\0\0\0"
    # When its owner shrinks the object (touching the mapping past the end would be a SIGBUS)
    os.ftruncate(block._fd, 4096)
    # Then reads and writes are refused, naming the region and what to do, and nothing crashed
    for access in (lambda: regions.read("input 'x'", "tail", 0, 4),
                   lambda: regions.write("output 'y'", "tail", 0, 4, b"abcd")):
        with pytest.raises(GatewayError, match=r"region 'tail' no longer fits its object .*: the "
                                               r"object holds 4096 bytes, the region was "
                                               r"registered at 8192 \+ 4096; unregister and "
                                               r"register it again"):
            access()
    # and once the object is whole again, the region serves again
    os.ftruncate(block._fd, 3 * 4096)
    regions.write("output 'y'", "tail", 0, 4, b"abcd")
    assert regions.read("x", "tail", 0, 4) == b"abcd"
    regions.close()
