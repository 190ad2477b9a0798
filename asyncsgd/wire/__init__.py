"""The parameter server's wire: protocol (spec in PROTOCOL.md), ZeroMQ transport, CURVE
security, the flat parameter layout, and the ``ps-stats`` client.
"""
