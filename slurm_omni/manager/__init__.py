"""The requeue manager daemon: event sources, journal, actions."""
