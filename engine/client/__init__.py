"""Reaching an engine from outside its process: start `python -m engine serve` (or `proxy`, or a
peer's HTTP server) as a child process, wait until it says it is ready, talk to it, stop it and
whatever it started.

One module for everything that drives a server from outside: `engine bench`, the scripts under
`tools/` and the end-to-end tests. It lives in the package because all three may import the
package, while tools never import tests and tests never import tools.
"""
