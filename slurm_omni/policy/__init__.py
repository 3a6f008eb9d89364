"""Pure decision code: failure confirmation and replacement placement. Runs no command."""
