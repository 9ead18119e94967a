"""The engine's actors: one OS process per role, talking over shared-memory rings."""
