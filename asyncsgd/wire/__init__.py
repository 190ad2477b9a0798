"""The parameter server's wire: the protocol (spec in PROTOCOL.md beside it), the
ZeroMQ transport at the edge, CURVE security (and the ZMTP greeting that names a
server's mechanism), the flat parameter layout and its signature, and the ``ps-stats``
client."""
