"""The package version, in a leaf module so the plan cache can key on it without importing the package."""

__version__ = "0.1.0"
