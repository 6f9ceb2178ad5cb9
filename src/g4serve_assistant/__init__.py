"""Voice banking assistant: audio front end, deterministic text core and app. A package of its own beside
``g4serve`` (install the ``assistant`` extra), driving the model through ``AsyncLLMEngine``'s public
methods only."""
