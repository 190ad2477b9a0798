"""The parameter server: its front, shard processes and rules (``server.serve`` starts one)."""
