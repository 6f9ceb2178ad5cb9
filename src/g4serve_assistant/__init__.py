"""Voice banking assistant: audio front end, deterministic text core and app."""
