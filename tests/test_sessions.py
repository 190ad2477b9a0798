"""Session tokens (PROTOCOL.md, Admission): bound to the worker id and the incarnation,
under one server start's key. Pure ``Sessions``."""

from asyncsgd.servers.sessions import Sessions
from asyncsgd.wire.protocol import PULL, PUSH, STATS, Message


def _msg(worker, incarnation, token, kind=PUSH, **meta):
    return Message(type=kind, worker=worker, incarnation=incarnation, token=token, meta=meta)


def test_a_token_admits_only_the_id_and_incarnation_it_was_handed_out_for():
    sessions = Sessions.new()
    token = sessions.token("w", 5)
    assert sessions.admits(_msg("w", 5, token))
    assert sessions.admits(_msg("w", 5, token))  # remembered: the same answer
    assert not sessions.admits(_msg("w", 6, token))  # its own token, a newer incarnation
    assert not sessions.admits(_msg("w", 4, token))  # an older one
    assert not sessions.admits(_msg("v", 5, token))  # another id
    assert not Sessions.new().admits(_msg("w", 5, token))  # another start of the server
    assert sessions.admits(_msg("", 0, "", kind=STATS))
    assert sessions.admits(_msg("", 0, "", kind=PULL, observer=True))
