"""Test facilities the engine's own processes must be able to load (spawned actors cannot
import from tests/); nothing here is active unless a test turns it on."""
