"""Imported first by a fork server: pauses the garbage collector for the preload after it.

Importing torch makes several hundred thousand objects, and every full collection during
the import walks all those made so far; ``frozen``, imported last, freezes them and turns
the collector back on.
"""

import gc

gc.disable()
