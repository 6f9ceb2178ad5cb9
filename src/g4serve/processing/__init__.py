"""Request-side preprocessing: media (image, video, audio) to model inputs, matching transformers' Gemma 4."""
