"""The project's own tools, run from a source checkout (`python -m tools.docs`). Not shipped."""
