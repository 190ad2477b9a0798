"""Parameter-server shards (built on the asyncsgd core; see the parameter-server issue)."""
