"""kombu's own unit tests of its Redis transport, run against the project's (asyncinfer/broker/transport.py).

``kombu_test_redis.py`` and ``kombu_conftest.py`` are ``t/unit/transport/test_redis.py`` and
``t/unit/conftest.py`` of the kombu 5.7.0 source distribution, unchanged (kombu's BSD licence is in
``LICENSE``). They are not collected with the project's tests (they patch kombu's poller for the
whole process): tests/integration/test_kombu_upstream.py runs them in a process of their own with
:mod:`tests.kombu_upstream.shim`, which puts the project's Channel, Transport, their Sentinel forms
and QoS where kombu's tests look for kombu's, so that every test kombu's transport passes, the
project's passes too.
"""

#: The kombu release these tests come from.
KOMBU_VERSION = "5.7.0"
