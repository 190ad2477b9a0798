"""Imported last by a fork server, after its preload: freezes what the imports made.

``gc.freeze`` moves every object alive into a generation no collection walks, so no child
forked from the server walks torch's objects in its collections, nor writes to their pages
(which it shares with the server until either writes to them). Then it turns the collector
back on (``gc_paused``, imported first, turned it off).
"""

import gc

gc.freeze()
gc.enable()
