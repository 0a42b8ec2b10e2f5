"""Core records shared by every concern: units, errors, memory classes, the timeline's records and files."""
