"""diprl: league reinforcement learning of LLM policies for no-press Diplomacy."""

__version__ = "0.1.0"
