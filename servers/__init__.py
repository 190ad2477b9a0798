"""The parameter server: its front, shard processes, their rules and update rules (built on
the asyncsgd core; ``server.serve`` starts one)."""
