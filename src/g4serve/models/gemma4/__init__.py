"""Gemma 4: text decoder, vision and audio towers, loader."""
