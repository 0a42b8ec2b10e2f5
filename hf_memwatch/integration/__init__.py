"""The Trainer integration: the ``MemWatch`` callback, the auto mode, and every patch of Trainer methods."""
