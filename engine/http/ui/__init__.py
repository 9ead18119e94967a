"""The chat page at `/`: its routes (page.py) and its static files (static/)."""
