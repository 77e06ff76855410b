"""The vLLM compatibility matrix (`make compat`, docs/install.md). Not shipped."""
