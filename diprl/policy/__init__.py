"""Policy layer: prompts, the decoding constraint and the order parser. No ray here."""
