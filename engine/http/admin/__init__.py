"""The admin socket (health, stats, actors, requests, abort, drain, shutdown, log level) and
where each server's socket lives."""
