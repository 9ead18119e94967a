"""The root side of request handling: the registry of every unfinished request (the gateway),
each request's output stream, the data-parallel router and the replica set."""
