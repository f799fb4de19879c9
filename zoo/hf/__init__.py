"""Hugging Face checkpoint formats."""
