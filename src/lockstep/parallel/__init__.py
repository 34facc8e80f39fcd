"""Data-parallel wrappers: each changes or wraps a model for the Trainer."""
