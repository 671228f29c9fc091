"""Persistent state between runs: the on-disk KV store (`store.py`) and conversation histories
(`conversations.py`)."""
