"""The root's requests in flight: the registry of every unfinished request (`Gateway`, the one
place a request's truth lives), each request's output stream, the data-parallel router and the
replica set."""
