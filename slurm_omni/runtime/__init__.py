"""The migratable training runtime (torch)."""
