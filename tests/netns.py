"""Several "hosts" on one machine, for multi-host tests: the library's ``Hosts``.

    from netns import Hosts, can_make_namespaces

    ok, why = can_make_namespaces()          # (False, 'needs ...; ...') when not root, no `ip`, ...
    with Hosts(["a", "b", "c"]) as hosts:
        hosts.address("a")                   # '10.213.7.1'
        server = hosts.popen("a", [sys.executable, "-c", "..."], stdout=subprocess.PIPE)

It lives in ``asyncsgd.run.hosts`` (namespaces on a switch, links optionally shaped
with ``link=Link.parse("100mbit")``) and ``asyncsgd.run.namespaces`` (may we, list,
sweep); this module keeps the tests' old import path.
"""

from asyncsgd.run.hosts import Hosts
from asyncsgd.run.link import Link
from asyncsgd.run.namespaces import (PREFIX, can_make_namespaces, can_shape_links, ip_binary,
                                     list_namespaces, sweep_stale)

__all__ = ["Hosts", "Link", "PREFIX", "can_make_namespaces", "can_shape_links", "ip_binary",
           "list_namespaces", "sweep_stale"]
