"""The ``netns_hosts`` fixture: a factory of N hosts in network namespaces (tests/netns/hosts.py),
all removed at the end of the test, even on failure. Skips with the reason where ``ip netns`` is
not permitted."""

from __future__ import annotations

import pytest

from tests.netns.hosts import Hosts, NetnsUnavailable


@pytest.fixture
def netns_hosts():
    made: list[Hosts] = []

    def make(n: int) -> Hosts:
        try:
            hosts = Hosts.create(n)
        except NetnsUnavailable as exc:
            pytest.skip(f"network namespaces are not available here: {exc}")
        made.append(hosts)
        return hosts

    yield make
    for hosts in made:
        hosts.close()
