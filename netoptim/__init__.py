"""netoptim's command line and local launcher."""

__version__ = "0.1.0"
